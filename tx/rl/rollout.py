"""Rollouts: each prompt's `n` episodes, sampled on the tx backend and scored by their envs, turn by turn.

Token in, token out: the sampled tokens are kept exactly as drawn (with their sampler log-probs, which
equal `forward`'s in float32, so they serve as the "old" log-probs of the update); an env's observations
are rendered with the tokenizer's chat template and appended with loss mask 0. All episodes of a turn go to
the policy (`tx.rl.policy`) in one `sample` call; the first turn sends each prompt once with `n` samples, so the engine
prefills it once and the samples share its pages. Env calls run in an `EnvPool` (threads).
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Any

from tx import types
from tx.rl.env import EnvPool, Message, make_env
from tx.rl.policy import SampleRequest


@dataclass
class PromptRow:
    """One data row: the chat prompt, its env class and every other column (handed to `Env.init`)."""

    prompt: list[Message]
    env_class: str
    extras: dict[str, Any] = field(default_factory=dict)


@dataclass
class Trajectory:
    """One episode. `response_ids` holds every token after the prompt: sampled ones (loss mask 1, their
    sampler log-probs) and observation / template tokens (mask 0, log-prob 0)."""

    group: int  # the prompt's index in the batch: the GRPO / RLOO group
    prompt_ids: list[int]
    model_id: str = ""
    seed: tuple[int, ...] = ()
    response_ids: list[int] = field(default_factory=list)
    loss_mask: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    turn_rewards: list[float] = field(default_factory=list)
    reward_positions: list[int] = field(default_factory=list)  # index in response_ids of each turn's last token
    stop_reason: str = "stop"  # of the last generation: "stop" or "length" (also: the context ran out)
    env_errors: list[str] = field(default_factory=list)
    done: bool = False

    @property
    def reward(self) -> float:
        return float(sum(self.turn_rewards))

    def generated_tokens(self) -> int:
        return int(sum(self.loss_mask))


@dataclass(frozen=True)
class RolloutParams:
    n_samples: int
    max_turns: int
    max_input_length: int
    max_seq_len: int  # prompt + everything after it, at most (the backend's limit)
    sampling: types.SamplingParams  # max_tokens = the seed's max_generate_length
    chat_template_kwargs: dict[str, Any]
    env_configs: dict[str, Any]  # environment.skyrl_gym: config per env class


class ChatTokens:
    """The tokenizer's chat template as token ids: a prompt, and the tokens an observation adds after a
    sampled assistant turn."""

    def __init__(self, tokenizer, template_kwargs: dict[str, Any]):
        self.tokenizer, self.kwargs = tokenizer, template_kwargs
        self.eos = tokenizer.eos_token_id
        base = [{"role": "user", "content": "u"}, {"role": "assistant", "content": "a"}]
        base_text = self._render(base, False)
        # what the template writes after an assistant's content: e.g. "<|im_end|>\n"
        self.closing = base_text[base_text.rindex("a") + 1:]
        self._base, self._base_text = base, base_text

    def _render(self, messages: list[Message], generation_prompt: bool) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt,
                                                  **self.kwargs)

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def prompt(self, messages: list[Message]) -> list[int]:
        return self.encode(self._render(messages, True))

    def observation(self, observations: list[Message], ended_with_eos: bool) -> list[int]:
        """Tokens between a sampled turn and the next one: the rest of the assistant turn's closing (all of
        it when sampling stopped without EOS), the observation messages, and the generation prompt."""
        text = self._render(self._base + observations, True)
        if not text.startswith(self._base_text):
            raise ValueError("the chat template renders earlier turns differently once observations follow; "
                             "tx.rl needs a template whose rendering of a conversation extends its prefix")
        closing = self.closing
        eos_text = self.tokenizer.decode([self.eos]) if self.eos is not None else ""
        if ended_with_eos and eos_text and closing.startswith(eos_text):
            closing = closing[len(eos_text):]
        return self.encode(closing + text[len(self._base_text):])


def _seed(*parts: int) -> int:
    """A request's sampling seed from (trainer seed, step, ...): stable across runs and resumes."""
    return zlib.crc32(",".join(map(str, parts)).encode()) & 0x7FFFFFFF


def rollout(policy, chat: ChatTokens, models: dict[str, tuple[int, ...]], rows: list[PromptRow],
            params: RolloutParams, pool: EnvPool) -> dict[str, list[Trajectory]]:
    """`params.n_samples` episodes of every row for each model id in `models` (model id -> its sampling seed
    parts), run to the end (env done, `max_turns`, or the length limits); sampled with each model's current
    weights, every model's episodes in the same backend calls. A model's samples depend only on its seed, its
    weights and the rows, never on the other models of the call."""
    envs, trajectories, extras, prompts = [], [], [], []
    for model_id, seed in models.items():
        for group, row in enumerate(rows):
            for _ in range(params.n_samples):
                envs.append(make_env(row.env_class, params.env_configs.get(row.env_class)))
                extras.append({**row.extras, "max_turns": params.max_turns})
                prompts.append(row.prompt)
                trajectories.append(Trajectory(group=group, prompt_ids=[], model_id=model_id, seed=seed))
    chats = pool.map_init(envs, prompts, extras)
    for t, messages in zip(trajectories, chats):
        t.prompt_ids = chat.prompt(messages)
    try:
        for turn in range(params.max_turns):
            live = [i for i, t in enumerate(trajectories) if not t.done]
            for i in live:
                t = trajectories[i]
                held = len(t.prompt_ids) + len(t.response_ids)
                if held > params.max_input_length or held >= params.max_seq_len:
                    t.stop_reason, t.done = "length", True
            live = [i for i in live if not trajectories[i].done]
            if not live:
                break
            outputs = _sample(policy, trajectories, live, params, turn)
            for i, seq in zip(live, outputs):
                t = trajectories[i]
                t.response_ids += seq.tokens
                t.loss_mask += [1] * len(seq.tokens)
                t.logprobs += list(seq.logprobs)
                t.stop_reason = seq.stop_reason
            texts = [chat.tokenizer.decode(seq.tokens, skip_special_tokens=True) for seq in outputs]
            steps = pool.map_step([envs[i] for i in live], texts)
            for i, seq, out in zip(live, outputs, steps):
                t = trajectories[i]
                t.turn_rewards.append(out.reward)
                t.reward_positions.append(max(len(t.response_ids) - 1, 0))
                if "error" in out.metadata:
                    t.env_errors.append(str(out.metadata["error"]))
                if out.done or turn == params.max_turns - 1:
                    t.done = True
                    continue
                ended = bool(seq.tokens) and seq.tokens[-1] == chat.eos
                obs = chat.observation(out.observations, ended)
                t.response_ids += obs
                t.loss_mask += [0] * len(obs)
                t.logprobs += [0.0] * len(obs)
    finally:
        pool.map_close(envs)
    out: dict[str, list[Trajectory]] = {model_id: [] for model_id in models}
    for t in trajectories:
        # an episode stopped by a length limit after an observation ends with that observation: drop it
        # (nothing trains on it), as SkyRL trims after the last sampled token
        last = max((j for j, m in enumerate(t.loss_mask) if m), default=-1) + 1
        del t.response_ids[last:], t.loss_mask[last:], t.logprobs[last:]
        out[t.model_id].append(t)
    return out


def _sample(policy, trajectories: list[Trajectory], live: list[int], params: RolloutParams,
            turn: int) -> list[types.GeneratedSequence]:
    """One policy call for every live episode's next turn; the first turn asks each (model, prompt) once for
    its samples (one prefill, shared pages; episodes whose env rewrote the prompt differently go apart).
    Request seeds come from the model's seed, the turn and the first episode's place within its model's batch."""
    by_key: dict[tuple, list[int]] = {}
    for i in live:
        t = trajectories[i]
        key = (t.model_id, t.group, tuple(t.prompt_ids)) if turn == 0 else (t.model_id, i)
        by_key.setdefault(key, []).append(i)
    first_of_model = {}
    for i, t in enumerate(trajectories):
        first_of_model.setdefault(t.model_id, i)
    groups, requests = list(by_key.values()), []
    for members in groups:
        t = trajectories[members[0]]
        ids = t.prompt_ids + t.response_ids
        place = members[0] - first_of_model[t.model_id]
        sp = params.sampling.model_copy(update={"seed": _seed(*t.seed, turn, place),
                                                "max_tokens": min(params.sampling.max_tokens, params.max_seq_len - len(ids))})
        requests.append(SampleRequest(t.model_id, ids, len(members), sp))
    sequences: dict[int, types.GeneratedSequence] = {}
    for members, seqs in zip(groups, policy.sample(requests)):
        for i, seq in zip(members, seqs):
            sequences[i] = seq
    return [sequences[i] for i in live]
