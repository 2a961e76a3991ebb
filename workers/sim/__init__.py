"""The simulated engine: the real scheduler and block manager, with the model replaced by a cost model.

A simulated replica queues, chunks, shares prefixes, evicts and preempts exactly as a real one does,
because it is the same code; only the forward pass is replaced, by a step time predicted from the
batch's shape (cost_model) with coefficients measured on this machine or derived from published GPU
figures (profiles). It runs either in real time, sleeping each step's predicted time so a server in
front of it behaves like the profiled hardware, or in virtual time, for a discrete-event fleet
simulator that advances its own clock.
"""
