"""The request pipeline, read → decide → forward: what the gateway reads of a request, the routing
decision, and the relay of the answer (plain, paired prefill/decode, or continued after a failure)."""
