"""Several models under one daemon: which may be served (registry), what fits (budget, estimate), and the pool that loads them on demand and unloads them when idle."""
