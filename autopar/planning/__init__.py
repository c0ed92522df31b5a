"""The planning path: the plan of one model on a grid (planner), the search over grids (search), machines and their
calibration."""
