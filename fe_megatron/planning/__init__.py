"""``fe-plan``: parameter budgets (`budget`) and what one rank holds for a parallel layout
(`rank_memory`).  Reads configs only; builds no model."""
