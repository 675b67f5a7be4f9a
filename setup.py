"""Build hook only (metadata lives in pyproject.toml): ship the two top-level remote-code files inside the wheel."""

import os

from setuptools import setup
from setuptools.command.build_py import build_py

REMOTE_CODE_FILES = ("configuration_dspark.py", "modeling_dspark.py")


class BuildPyWithRemoteCode(build_py):
    def run(self):
        super().run()
        if getattr(self, "editable_mode", False):  # an editable install serves them from the repository root
            return
        self.mkpath(os.path.join(self.build_lib, "dspark_hf", "remote_code"))
        for name in REMOTE_CODE_FILES:
            self.copy_file(name, os.path.join(self.build_lib, "dspark_hf", "remote_code", name))


setup(cmdclass={"build_py": BuildPyWithRemoteCode})
