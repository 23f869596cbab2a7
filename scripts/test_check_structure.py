"""scripts/check-structure.py on fixture trees: a cycle, an oversize file and a clean tree are
each reported as they should be, and what is not a module reference (comments, strings, test
blocks, `$crate`, visibilities) makes no edge.

    python3 scripts/check-structure.py --self-test      # make lint runs it before the check
"""

from __future__ import annotations

import atexit
import importlib.util
import shutil
import subprocess
import sys
import tempfile
import textwrap
import unittest
from pathlib import Path

SCRIPT = Path(__file__).resolve().parent / "check-structure.py"
_spec = importlib.util.spec_from_file_location("check_structure", SCRIPT)
cs = importlib.util.module_from_spec(_spec)
sys.modules["check_structure"] = cs
_spec.loader.exec_module(cs)


def tree(files: dict) -> Path:
    root = Path(tempfile.mkdtemp(prefix="check-structure-"))
    atexit.register(shutil.rmtree, root, ignore_errors=True)
    for rel, text in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text) if isinstance(text, str) else text)
    return root


def run(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, str(SCRIPT), "--root", str(root), *args],
        capture_output=True, text=True, timeout=60,
    )


def lines(n: int) -> str:
    return "".join(f"// line {i}\n" for i in range(n))


# A small core with no cycle, exercising every way of naming a module.
CLEAN = {
    "core/src/lib.rs": "pub mod a;\npub mod b;\npub mod c;\npub mod fleet;\n",
    "core/src/a.rs": "pub struct A;\n",
    "core/src/b.rs": """\
        use crate::{a::A, c};
        pub fn f() -> A { c::g(); crate::a::A }
    """,
    "core/src/c.rs": """\
        //! c names b only where it does not count: comments, strings, test blocks, macros.
        // use crate::b;
        /* crate::b::f() /* nested */ crate::b::f() */
        pub(in crate::c) fn h() {}
        pub fn g() -> &'static str { let _c = 'x'; let _q = '\\''; r#"crate::b::f()"# }
        macro_rules! m { () => { $crate::b::f() }; }
        #[cfg(test)]
        mod tests {
            use super::*;
            use crate::b::f;
        }
    """,
    # A folder module whose children name each other and the crate, never their parent.
    "core/src/fleet/mod.rs": "mod ask;\nmod settings;\npub use ask::Ask;\n",
    "core/src/fleet/settings.rs": "pub struct Settings;\n",
    "core/src/fleet/ask.rs": "use super::settings::Settings;\npub struct Ask(pub Settings, pub crate::a::A);\n",
    "src/host/mod.rs": "use proxy_wasm::traits::Context;\n" + lines(100),
}


class Graph(unittest.TestCase):
    def graph(self, files: dict) -> "cs.Graph":
        return cs.build_graph(tree(files))

    def test_every_way_of_naming_a_module_is_an_edge(self):
        g = self.graph(CLEAN)
        self.assertEqual(sorted(g.edges["b"]), ["a", "c"])
        self.assertEqual(sorted(g.edges["fleet"]), ["fleet::ask"])
        self.assertEqual(sorted(g.edges["fleet::ask"]), ["a", "fleet::settings"])
        self.assertEqual(g.edges["crate"], {})  # `mod` declarations are not edges

    def test_comments_strings_tests_macros_and_visibility_are_not_edges(self):
        self.assertEqual(self.graph(CLEAN).edges["c"], {})

    def test_super_and_self_resolve_from_inline_modules(self):
        g = self.graph({
            "core/src/lib.rs": "mod x;\nmod y;\n",
            "core/src/x/mod.rs": "mod deep;\n",
            "core/src/x/deep.rs": "pub mod inner { use super::super::super::y::Y; }\nfn f() { self::inner::g(); }\n",
            "core/src/y.rs": "pub struct Y;\n",
        })
        self.assertEqual(sorted(g.edges["x::deep"]), ["y"])

    def test_an_imported_module_used_as_a_path_names_what_it_reaches(self):
        g = self.graph({
            "core/src/lib.rs": "mod x;\nmod y;\n",
            "core/src/x/mod.rs": "pub mod z;\n",
            "core/src/x/z.rs": "pub fn f() {}\n",
            "core/src/y.rs": "use crate::x;\nfn g() { x::z::f() }\n",
        })
        self.assertEqual(sorted(g.edges["y"]), ["x", "x::z"])


class Check(unittest.TestCase):
    def test_a_clean_tree_passes(self):
        result = run(tree(CLEAN))
        self.assertEqual(result.returncode, 0, result.stdout + result.stderr)
        self.assertIn("ok", result.stdout)

    def test_a_cycle_is_reported_with_its_members_and_a_path(self):
        files = dict(CLEAN)
        # b -> c (CLEAN) and now c -> b: one cycle. And a child that names its parent, which
        # re-exports it: a second one.
        files["core/src/c.rs"] = "pub fn g() { crate::b::f(); }\n"
        files["core/src/fleet/ask.rs"] = "use super::{settings::Settings, Ask as _};\npub struct Ask;\n"
        result = run(tree(files))
        self.assertEqual(result.returncode, 1)
        cycles = [l for l in result.stdout.splitlines() if "import cycle" in l]
        self.assertEqual(len(cycles), 2, result.stdout)
        self.assertIn("2 modules (b, c)", result.stdout)
        self.assertIn("b -> c (core/src/b.rs:1) -> b (core/src/c.rs:1)", result.stdout)
        self.assertIn("2 modules (fleet, fleet::ask)", result.stdout)
        self.assertIn("fleet -> fleet::ask (core/src/fleet/mod.rs:3) -> fleet (core/src/fleet/ask.rs:1)", result.stdout)

    def test_a_cycle_among_a_folders_children_is_reported(self):
        files = dict(CLEAN)
        files["core/src/fleet/settings.rs"] = "pub struct Settings(super::ask::Ask);\n"
        result = run(tree(files))
        self.assertEqual(result.returncode, 1)
        self.assertIn("2 modules (fleet::ask, fleet::settings)", result.stdout)

    def test_oversize_files_and_budgets_are_reported(self):
        files = dict(CLEAN)
        files["integration/sim/src/big.rs"] = lines(cs.FILE_LINES + 1)
        files["core/tests/ok.rs"] = lines(cs.FILE_LINES)
        files["src/native/abi.rs"] = lines(cs.FILE_LINES + 200)  # bindings: exempt
        files["target/debug/build/huge.rs"] = lines(5000)  # build output: not ours
        files["core/src/worker.rs"] = lines(cs.WORKER_LINES + 1)
        files["src/native/mod.rs"] = lines(cs.NATIVE_HOST_LINES + 1)
        files["src/host/abi.rs"] = "use proxy_wasm::hostcalls;\n" + lines(cs.PROXY_WASM_HOST_LINES)  # bindings
        files["src/host/adapters.rs"] = "use proxy_wasm::types::Status;\n" + lines(cs.PROXY_WASM_HOST_LINES - 100)
        files["src/host/plain.rs"] = "// proxy_wasm is named in a comment only\n" + lines(300)
        result = run(tree(files))
        self.assertEqual(result.returncode, 1)
        out = result.stdout.splitlines()
        self.assertEqual(len(out), 4, result.stdout)
        self.assertTrue(out[0].startswith(f"check-structure: integration/sim/src/big.rs: {cs.FILE_LINES + 1} lines, over"))
        self.assertIn(f"proxy-wasm host's glue (files under src/ that name proxy_wasm, bindings aside): "
                      f"{cs.PROXY_WASM_HOST_LINES + 2} lines (src/host/adapters.rs 351 + src/host/mod.rs 101)",
                      result.stdout)
        self.assertIn(f"src/native/mod.rs): {cs.NATIVE_HOST_LINES + 1} lines, over its budget of {cs.NATIVE_HOST_LINES}", result.stdout)
        self.assertIn(f"core/src/worker.rs): {cs.WORKER_LINES + 1} lines, over its budget of {cs.WORKER_LINES}", result.stdout)
        for absent in ("abi.rs:", "huge.rs", "ok.rs", "plain.rs"):
            self.assertNotIn(absent, result.stdout)

    def test_the_report_never_fails(self):
        files = dict(CLEAN)
        files["core/src/c.rs"] = "pub fn g() { crate::b::f(); }\n"
        files["core/src/worker.rs"] = lines(cs.WORKER_LINES + 1)
        result = run(tree(files), "--report")
        self.assertEqual(result.returncode, 0, result.stderr)
        self.assertIn("[cycle: b, c]", result.stdout)
        self.assertIn("OVER", result.stdout)


if __name__ == "__main__":
    unittest.main()
