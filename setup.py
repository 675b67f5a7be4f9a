"""Build hook only (metadata lives in pyproject.toml): ship the top-level remote-code files inside the wheel."""

import ast
import os

from setuptools import setup
from setuptools.command.build_py import build_py


def remote_code_files() -> tuple[str, ...]:
    """`REMOTE_CODE_FILES` as written in configuration_dspark.py (read, not imported: the build has no torch)."""
    with open("configuration_dspark.py") as source:
        tree = ast.parse(source.read())
    assignment = next(node for node in tree.body if isinstance(node, ast.Assign)
                      and getattr(node.targets[0], "id", None) == "REMOTE_CODE_FILES")
    return ast.literal_eval(assignment.value)


class BuildPyWithRemoteCode(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):  # an editable install serves them from the repository root
            return
        self.mkpath(os.path.join(self.build_lib, "dspark_hf", "remote_code"))
        for name in remote_code_files():
            self.copy_file(name, os.path.join(self.build_lib, "dspark_hf", "remote_code", name))


setup(cmdclass={"build_py": BuildPyWithRemoteCode})
