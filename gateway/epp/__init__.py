"""The gateway as the endpoint picker (EPP) of an Envoy-based inference gateway: Envoy asks, over its
external-processing protocol, which replica serves each request, and relays the request there itself
(docs/kubernetes.md). The choice is the proxy's (gateway.forward.choice); what the answer teaches is
learned as in proxy mode (gateway.forward.outcome)."""
