"""Running models fast on this machine: PyTorch runners (`causal_runner`, `static_runner`), kernels
measured per machine (`kernels`, `attention`, `int8`), devices and dtypes (`devices`), what was
measured here and is remembered (`measured`), which drafter backend drafts fastest (`backends`),
and the requests running in this process (`activity`). Importing one module loads no other.
"""
