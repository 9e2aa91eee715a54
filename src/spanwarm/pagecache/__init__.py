"""Page cache access: residency (cachestat, mincore, RWF_NOWAIT samples), mappings, the
device's read-ahead window, and the warm engine (reads and MADV_POPULATE_READ)."""
