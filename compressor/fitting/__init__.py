"""The fit stage: closed-form solves (solve), which hidden units to keep (obs),
the replacement kinds (kinds/: affine, low_rank, prune, hybrid) and the module swap (replace)."""
