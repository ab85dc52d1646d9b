"""What the SFT and RL trainers share."""
