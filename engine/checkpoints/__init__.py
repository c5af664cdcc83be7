"""Checkpoints: the run's manager that resumes and saves (`manager`), where checkpoints live and how
one is published (`store`), what each records of the layout that saved it and which resumes must
convert (`reshape`), the check that a resumed checkpoint is whole (`integrity`), the conversions
through DeepSpeed's universal form (`universal`, `from_torch`, `to_torch`) and the export
(`export`). Imports nothing itself, so each part costs only what it uses."""
