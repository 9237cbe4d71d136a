"""The fault drill (bench/fault_drill.py): its rig, faults, cells, load figure and tables."""
