"""Named models: bundles on disk, the model repository a worker serves."""
