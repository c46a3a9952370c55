"""k3rocm's tests, one folder per package folder (tests/<folder>/ tests k3rocm/<folder>/ or the top-level
kernels/, cli/, validation/ packages; tests/test_<module>.py tests k3rocm/<module>.py). Each folder is a package,
so test files may share a name across folders and shared code is imported as ``tests.helpers``."""
