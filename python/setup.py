"""Marks the wheel as platform-specific: it carries libmkernel.so (Linux x86_64) but no
CPython extension, so one wheel serves every Python version (tag py3-none-<platform>)."""

from setuptools import setup
from setuptools.command.bdist_wheel import bdist_wheel
from setuptools.dist import Distribution


class BinaryDistribution(Distribution):
    def has_ext_modules(self):
        return True


class PythonIndependentWheel(bdist_wheel):
    def get_tag(self):
        _python, _abi, platform = super().get_tag()
        return "py3", "none", platform


setup(distclass=BinaryDistribution, cmdclass={"bdist_wheel": PythonIndependentWheel})
