from Cython.Build import cythonize
from setuptools import Extension, setup

core = Extension(
    "aio_datadist._core",
    ["aio_datadist/_core.pyx"],
    language="c++",
    extra_compile_args=["-O3", "-std=c++17"],
    libraries=["pthread", "dl"],
)

setup(ext_modules=cythonize([core], language_level=3))
