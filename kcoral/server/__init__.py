"""The KCoral server: runs programs on one device for remote clients."""
