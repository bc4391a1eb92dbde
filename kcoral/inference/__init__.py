"""
The Open Inference Protocol (KServe v2, as Triton serves it) on every
KCoral front: one interface, L{kcoral.inference.front.IInferenceFront}, that
a standalone server, a node's gateway and the Router each implement, and the
adapters that put any of them on the wire, in REST
(L{kcoral.inference.rest}) and gRPC (L{kcoral.inference.h2front}, the methods
in L{kcoral.inference.grpcmethods}).
"""
