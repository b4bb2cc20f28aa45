import copy
import unittest

from buildgraph.deps import CycleError, build_order, parse_deps


class VerifyDeps(unittest.TestCase):
    def test_parse(self):
        text = "app: lib utils\nlib: utils  # shared code\n\nutils:\n"
        self.assertEqual(parse_deps(text),
                         {"app": {"lib", "utils"}, "lib": {"utils"}, "utils": set()})
        with self.assertRaises(ValueError):
            parse_deps("no colon here")

    def test_chain(self):
        self.assertEqual(build_order({"app": {"lib"}, "lib": {"core"}}), ["core", "lib", "app"])

    def test_diamond(self):
        deps = {"app": {"web", "cli"}, "web": {"core"}, "cli": {"core"}, "core": set()}
        self.assertEqual(build_order(deps), ["core", "cli", "web", "app"])

    def test_alphabetically_first_ready_package(self):
        self.assertEqual(build_order({"b": {"a"}, "a": set(), "c": set()}), ["a", "b", "c"])
        self.assertEqual(build_order({"z": set(), "y": {"z"}, "x": {"y"}, "w": set()}),
                         ["w", "z", "y", "x"])

    def test_dependency_only_packages(self):
        self.assertEqual(build_order({"app": {"zlib", "json"}}), ["json", "zlib", "app"])

    def test_empty(self):
        self.assertEqual(build_order({}), [])

    def test_cycle(self):
        with self.assertRaises(CycleError) as ctx:
            build_order({"a": {"b"}, "b": {"a"}, "c": set()})
        self.assertEqual(ctx.exception.packages, ["a", "b"])
        self.assertIsInstance(ctx.exception, ValueError)

    def test_cycle_blocks_dependents(self):
        with self.assertRaises(CycleError) as ctx:
            build_order({"app": {"x"}, "x": {"y"}, "y": {"x"}, "ok": set()})
        self.assertEqual(ctx.exception.packages, ["app", "x", "y"])

    def test_self_dependency(self):
        with self.assertRaises(CycleError):
            build_order({"a": {"a"}})

    def test_input_unchanged(self):
        deps = {"app": {"lib"}, "lib": set()}
        before = copy.deepcopy(deps)
        build_order(deps)
        self.assertEqual(deps, before)


if __name__ == "__main__":
    unittest.main()
