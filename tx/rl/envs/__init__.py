"""Built-in environments; importing this package registers them (`tx.rl.env` imports it).

- `gsm8k`: grade-school math, reward 1 for the right final answer (the seed's default `env_class`).
- `letters`: an offline toy reward a tiny random model can learn, for smoke tests and examples.
- `guess`: a multi-turn number-guessing game, the example of an env that answers the model.
"""

from tx.rl.envs import gsm8k, guess, letters

__all__ = ["gsm8k", "guess", "letters"]
