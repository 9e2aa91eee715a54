"""Planning: the cost model (bridge gaps, spans or the whole file), the seek cost and its
measurement per mount (calibrate), and the what-if planner of a node's reads."""
