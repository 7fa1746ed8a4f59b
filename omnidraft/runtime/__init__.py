"""Running models fast on this machine: PyTorch runners (`causal_runner`, `static_runner`), kernels
measured per machine (`kernels`, `attention`, `int8`), devices and dtypes (`devices`), what was
measured here and is remembered (`measured`), and which drafter backend drafts fastest
(`backends`). Importing one module loads no other.
"""
