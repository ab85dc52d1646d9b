"""What the SFT and RL trainers share: the mesh fields of their configs (`mesh`), the seed config sections both
read (`seed_config`), YAML + `key=value` overrides (`overrides`), data rows and their seeded order (`data`), the
learning-rate schedules (`schedule`), and the step-directory layout of checkpoints (`step_dirs`)."""
