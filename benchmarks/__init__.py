"""The benchmarks, a folder per question (benchmarks/README.md). A package so that a script run
by path finds its helpers by one absolute name (``benchmarks.common.gpu_setup``) once it has put
the checkout on ``sys.path``."""
