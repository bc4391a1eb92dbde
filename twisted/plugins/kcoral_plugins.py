from twisted.application.service import ServiceMaker

kcoralRouter = ServiceMaker(
    "KCoral Router", "kcoral.taps.router",
    "One stable address in front of a pool of KCoral nodes.", "kcoral-router")

kcoralNode = ServiceMaker(
    "KCoral node", "kcoral.taps.node",
    "A KCoral server, or with --router a node supervisor.", "kcoral-node")
