"""Computation on the aggregators' shares without reconstructing them: the secure AUC (see `secure_auc`)."""
