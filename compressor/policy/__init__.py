"""The policy: which blocks to replace, by how much, within the gate's budget.

plan → allocate → gate → apply: plan (pass A: profiles, fits or error curves), options (a unit's
ways to be realised, with size and predicted cost, and their allocation), allocate (FFN widths as
options, one global cut split across blocks), search (the gate's bisection over one target), gate
(the allocate strategy's gate), apply (fits installed, decisions recorded); select and greedy
(candidates, whole-block swaps rolled back over budget); result (what was decided); compress (the
policy engine that drives them).
"""
