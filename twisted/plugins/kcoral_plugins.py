from twisted.application.service import ServiceMaker

kcoralRouter = ServiceMaker(
    "KCoral Router", "kcoral.router.tap",
    "One stable address in front of a pool of KCoral nodes.", "kcoral-router")

kcoralNode = ServiceMaker(
    "KCoral node", "kcoral.node.tap",
    "A KCoral server, or with --router a node supervisor.", "kcoral-node")
