"""The Ray layer: cluster connection, resource pools, fused colocated workers, worker groups and dispatch."""
