"""spanwarm: per-node page-cache prefetch for distributed PyTorch checkpoint loading.

Every rank knows, before it reads anything, which tensors it holds and how; with the
safetensors headers that names the exact byte spans it will read. See README.md and
docs/ for the design. The rank-side API lives in :mod:`spanwarm.client`.
"""

__version__ = "0.1.0"
