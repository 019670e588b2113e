"""The select stage: which blocks to replace, by how much, within the gate's budget.

select (candidates and order), greedy (one block at a time, rolled back over
budget), allocate (one global cut split across blocks by their error curves),
compress (the policy engine that drives them).
"""
