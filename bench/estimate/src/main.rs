//! `estimate-accuracy [samples.jsonl]`: for every sample request, the estimator's input tokens
//! (`llm_governor_core::estimate`) against a reference count with tiktoken's `o200k_base`, as
//! OpenAI's cookbook counts chat prompts (3 tokens per message plus its role and text, 3 to
//! prime the reply; tools as their JSON). Anthropic and Gemini publish no tokenizer: their rows
//! use the same o200k reference, a proxy. Prints a Markdown table and the worst error.

use serde_json::Value;

fn text_of(v: &Value, bpe: &tiktoken_rs::CoreBPE) -> usize {
    match v {
        Value::String(s) => bpe.encode_ordinary(s).len(),
        Value::Array(items) => items.iter().map(|i| text_of(i, bpe)).sum(),
        Value::Object(o) => o
            .iter()
            .filter(|(k, _)| matches!(k.as_str(), "text" | "content" | "parts"))
            .map(|(_, v)| text_of(v, bpe))
            .sum(),
        _ => 0,
    }
}

fn reference(body: &Value, bpe: &tiktoken_rs::CoreBPE) -> usize {
    let mut n = 0;
    let messages = body.get("messages").or_else(|| body.get("contents"));
    if let Some(Value::Array(msgs)) = messages {
        for m in msgs {
            n += 3;
            if let Some(role) = m.get("role").and_then(Value::as_str) {
                n += bpe.encode_ordinary(role).len();
            }
            n += m
                .get("content")
                .or_else(|| m.get("parts"))
                .map_or(0, |c| text_of(c, bpe));
        }
        n += 3;
    }
    for key in ["system", "instructions", "input", "systemInstruction"] {
        if let Some(v) = body.get(key) {
            n += text_of(v, bpe);
        }
    }
    if let Some(tools) = body.get("tools") {
        n += bpe.encode_ordinary(&tools.to_string()).len();
    }
    n
}

fn main() {
    let path = std::env::args()
        .nth(1)
        .unwrap_or_else(|| "bench/estimate/samples.jsonl".into());
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        eprintln!("estimate-accuracy: {path}: {e}");
        std::process::exit(2)
    });
    let bpe = tiktoken_rs::o200k_base().expect("o200k_base ships inside tiktoken-rs");
    println!("| sample | dialect | body bytes | o200k reference | estimate | error |");
    println!("|---|---|---:|---:|---:|---:|");
    let (mut worst, mut sum_abs, mut count) = (0f64, 0f64, 0);
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let sample: Value = serde_json::from_str(line).expect("samples.jsonl holds JSON lines");
        let body = &sample["body"];
        let bytes = body.to_string();
        let real = reference(body, &bpe);
        let est = llm_governor_core::estimate::estimate(bytes.as_bytes(), bytes.len()).input;
        let err = (est as f64 - real as f64) / real as f64 * 100.0;
        worst = if err.abs() > worst.abs() { err } else { worst };
        sum_abs += err.abs();
        count += 1;
        println!(
            "| {} | {} | {} | {real} | {est} | {err:+.1} % |",
            sample["name"].as_str().unwrap_or("?"),
            sample["dialect"].as_str().unwrap_or("?"),
            bytes.len()
        );
    }
    println!(
        "\n{count} samples: mean |error| {:.1} %, worst {worst:+.1} %",
        sum_abs / count as f64
    );
}
