"""Prompt data for RL: local files -> validated, templated ``Prompt`` items -> a resumable batch stream.

Pipeline (rank 0, the controller, owns it)::

    data.prompt_data (files / save_to_disk folders)
        -> read rows (``sources.read_rows``)
        -> validate each row (input_key, label_key); a bad row raises ``DataError`` naming
           file, row and key, or is skipped and counted when ``data.skip_bad_rows``
        -> format: ``input_template`` and/or the tokenizer's chat template
        -> mix sources (``data.prompt_data_probs``, exact proportional counts, seeded)
        -> ``max_samples``
    PromptDataset  --PromptStream(batch_size, seed, num_episodes)-->  list[Prompt] per step
    tokenize_prompts(tokenizer, texts, prompt_max_len)  -> prompt token ids (left-truncated)

The dataset itself keeps file order (mixtures are interleaved by seed); the stream shuffles
every episode with ``(seed, episode)`` and can be checkpointed and resumed exactly.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, overload

import numpy as np

from hpc_rlhf.data.images import ImageRef, has_image_parts, require_no_images, row_images, with_image_parts
from hpc_rlhf.data.sources import DataError, SkippedRows, concatenate_or_mix, load_source, row_error
from hpc_rlhf.models.tokenizer_protocol import Tokenizer, render_chat_text

logger = logging.getLogger(__name__)

_MAX_REASONS_KEPT = 20


@dataclass(frozen=True)
class Prompt:
    """One prompt as the model sees it.

    ``text`` is final (template and chat template applied); ``source`` is the file it came from and
    ``index`` its row there, so any prompt in a log can be traced back to its row. ``data_source`` is the
    row's ``data_source`` column when it has one (evaluation reports metrics per data source). ``images``: the
    prompt's images in the order ``text`` places their placeholders (``hpc_rlhf.data.images``), none for text.
    """

    text: str
    label: Any | None
    source: str
    index: int
    data_source: str | None = None
    images: tuple[ImageRef, ...] = ()


def source_name(prompt: Prompt) -> str:
    """The data source a prompt is reported under (evaluation and the per-source training metrics): its
    ``data_source`` column, else its file's stem."""
    return prompt.data_source or Path(prompt.source).stem


def _check_messages(messages: list, path: str, row: int, key: str) -> None:
    if not messages:
        raise row_error(path, row, key, "empty list of chat messages")
    for turn, message in enumerate(messages):
        if not isinstance(message, dict) or not isinstance(message.get("role"), str) or "content" not in message:
            raise row_error(path, row, key,
                            f"message {turn} must be an object with 'role' and 'content', got {message!r:.120}")
        if not isinstance(message["content"], (str, list)):
            raise row_error(path, row, key,
                            f"message {turn} content must be a string, got {type(message['content']).__name__}")


def _check_template(input_template: str | None) -> None:
    if input_template is None:
        return
    probe = "\x00PROMPT\x00"
    try:
        filled = input_template.format(probe)
    except (IndexError, KeyError, ValueError) as err:
        raise DataError(
            f"data.input_template {input_template!r} is not a format string with one '{{}}' "
            f"({type(err).__name__}: {err}); write literal braces as '{{{{' and '}}}}'"
        ) from None
    if probe not in filled:
        raise DataError(f"data.input_template {input_template!r} has no '{{}}' placeholder for the prompt")


class PromptDataset(Sequence[Prompt]):
    """Validated, templated prompts from one or several local sources.

    Args:
        paths: files (``.jsonl``, ``.json``, ``.parquet``) or ``save_to_disk`` folders.
        input_key: column holding the prompt: a string, or (with ``apply_chat_template``) a
            list of ``{"role", "content"}`` messages.
        label_key: optional column holding the label passed to the reward function.
        input_template: a format string with ``{}``, e.g. ``"Question: {}\\nAnswer:"``. With
            ``apply_chat_template`` it is applied to the user text before the chat template (to
            the last user message when the input is a message list).
        apply_chat_template: wrap the prompt with ``tokenizer.apply_chat_template(...,
            add_generation_prompt=True, tokenize=False)``; a string becomes one user message.
        tokenizer: needed only for ``apply_chat_template``.
        probs: mixture probabilities, one per path. ``None`` concatenates the sources in order.
        max_samples: keep at most this many prompts. Without ``probs``: the first ones in file
            order (as OpenRLHF). With ``probs``: the mixture's total size (default: all usable rows
            of all sources), split exactly in proportion to ``probs``.
        seed: seeds the mixture.
        skip_bad_rows: skip (and count, ``num_skipped``) bad rows instead of raising ``DataError``.
        images_key: column holding a row's images (``hpc_rlhf.data.images``); image content parts in the
            messages are read too. Images need ``apply_chat_template`` (the template places them).
        text_only_model: the model path when the model takes no images: a row with images is then refused,
            naming the model and the key.
    """

    def __init__(
        self,
        paths: Sequence[str],
        *,
        input_key: str = "input",
        label_key: str | None = None,
        input_template: str | None = None,
        apply_chat_template: bool = False,
        tokenizer: Tokenizer | None = None,
        probs: Sequence[float] | None = None,
        max_samples: int | None = None,
        seed: int = 42,
        skip_bad_rows: bool = False,
        images_key: str = "images",
        text_only_model: str | None = None,
    ):
        if isinstance(paths, str):
            paths = [paths]
        if not paths:
            raise DataError("data.prompt_data is empty: give at least one prompt file or save_to_disk folder")
        if probs is not None and len(probs) != len(paths):
            raise DataError(f"data.prompt_data_probs has {len(probs)} entries for {len(paths)} data sources")
        if max_samples is not None and max_samples < 1:
            raise DataError(f"data.max_samples must be >= 1, got {max_samples}")
        _check_template(input_template)
        if apply_chat_template and getattr(tokenizer, "chat_template", None) is None:
            raise DataError(
                "data.apply_chat_template=true needs a tokenizer with a chat_template "
                "(the actor's tokenizer has none; set data.apply_chat_template=false or add a template)"
            )
        self.paths = list(paths)
        self.input_key = input_key
        self.label_key = label_key
        self.input_template = input_template
        self.apply_chat_template = apply_chat_template
        self.tokenizer = tokenizer
        self.skip_bad_rows = skip_bad_rows
        self.images_key = images_key
        self.text_only_model = text_only_model
        self.skipped = SkippedRows(max_reasons=_MAX_REASONS_KEPT, by_source={path: 0 for path in self.paths})
        self._prompts: list[Prompt] = concatenate_or_mix(self.paths, self._load_source, probs=probs,
                                                         max_samples=max_samples, seed=seed)

        if self.num_skipped:
            logger.warning(
                "skipped %d bad prompt rows (%s); first reasons: %s",
                self.num_skipped,
                ", ".join(f"{p}: {n}" for p, n in self.skipped_by_source.items() if n),
                " | ".join(self.skip_reasons[:3]),
            )
        if not self._prompts:
            raise DataError(f"no usable prompts in {self.paths} (skipped {self.num_skipped} bad rows)")

    @classmethod
    def from_config(cls, data: Any, tokenizer: Tokenizer | None = None, seed: int = 42,
                    text_only_model: str | None = None) -> PromptDataset:
        """Build from the ``data`` config section (``hpc_rlhf.config.schema.DataConfig``); ``text_only_model``: see
        the class."""
        return cls(
            data.prompt_data,
            input_key=data.input_key,
            label_key=data.label_key,
            input_template=data.input_template,
            apply_chat_template=data.apply_chat_template,
            tokenizer=tokenizer,
            probs=data.prompt_data_probs,
            max_samples=data.max_samples,
            seed=seed,
            skip_bad_rows=data.skip_bad_rows,
            images_key=data.images_key,
            text_only_model=text_only_model,
        )

    # -- Sequence -------------------------------------------------------------------------------
    def __len__(self) -> int:
        return len(self._prompts)

    @overload
    def __getitem__(self, index: int) -> Prompt: ...

    @overload
    def __getitem__(self, index: slice) -> list[Prompt]: ...

    def __getitem__(self, index: int | slice) -> Prompt | list[Prompt]:
        return self._prompts[index]

    @property
    def num_skipped(self) -> int:
        return self.skipped.total

    @property
    def skipped_by_source(self) -> dict[str, int]:
        return self.skipped.by_source

    @property
    def skip_reasons(self) -> list[str]:
        """The first few, for the log."""
        return self.skipped.reasons

    def source_counts(self) -> dict[str, int]:
        """Prompts per source in this dataset (after mixing and ``max_samples``)."""
        counts = {path: 0 for path in self.paths}
        for prompt in self._prompts:
            counts[prompt.source] += 1
        return counts

    # -- loading --------------------------------------------------------------------------------
    def _load_source(self, path: str, limit: int | None) -> list[Prompt]:
        prompts, _ = load_source(path, self._make_prompt, limit=limit, skip_bad_rows=self.skip_bad_rows,
                                 skipped=self.skipped)  # _make_prompt never returns None: nothing is dropped
        return prompts

    def _make_prompt(self, row: Any, path: str, row_index: int) -> Prompt:
        if not isinstance(row, dict):
            raise row_error(path, row_index, None, f"expected an object, got {type(row).__name__}")
        key = self.input_key
        if key not in row:
            raise row_error(path, row_index, key, f"missing (row has keys {sorted(row)[:10]})")
        value = row[key]
        if isinstance(value, str):
            if not value.strip():
                raise row_error(path, row_index, key, "empty prompt")
        elif self.apply_chat_template and isinstance(value, list):
            _check_messages(value, path, row_index, key)
        else:
            expected = "a string or a list of chat messages" if self.apply_chat_template else "a string"
            raise row_error(path, row_index, key, f"expected {expected}, got {type(value).__name__}")

        label = None
        if self.label_key is not None:
            if row.get(self.label_key) is None:
                state = "null" if self.label_key in row else "missing"
                raise row_error(path, row_index, self.label_key, f"label is {state}")
            label = row[self.label_key]
        data_source = row.get("data_source")
        if data_source is not None and not isinstance(data_source, str):
            raise row_error(path, row_index, "data_source", f"expected a string, got {type(data_source).__name__}")
        images = self._images(row, value, path, row_index)
        return Prompt(text=self._format(with_image_parts(value, len(images)), path, row_index), label=label,
                      source=path, index=row_index, data_source=data_source, images=images)

    def _images(self, row: dict, value: Any, path: str, row_index: int) -> tuple[ImageRef, ...]:
        column = row.get(self.images_key)
        if column is None and not has_image_parts(value):
            return ()
        images = row_images(value, column, path, row_index, self.input_key, self.images_key)
        if self.text_only_model is not None:
            require_no_images(images, self.text_only_model)
        if images and not self.apply_chat_template:
            raise row_error(path, row_index, images[0].key, "prompts with images need data.apply_chat_template=true "
                            "(the model's chat template places each image's tokens)")
        for image in images:
            image.check()
        return images

    def _format(self, value: str | list, path: str, row_index: int) -> str:
        template = self.input_template
        if not self.apply_chat_template:
            assert isinstance(value, str)  # _make_prompt takes chat messages only with the chat template
            return template.format(value) if template else value
        if isinstance(value, str):
            messages = [{"role": "user", "content": template.format(value) if template else value}]
        else:
            messages = [dict(m) for m in value]
            if template:
                users = [i for i, m in enumerate(messages) if m["role"] == "user" and isinstance(m["content"], str)]
                if users:
                    messages[users[-1]]["content"] = template.format(messages[users[-1]]["content"])
        try:
            assert self.tokenizer is not None  # __init__ refuses apply_chat_template without a tokenizer
            text = render_chat_text(self.tokenizer, messages, add_generation_prompt=True)
        except Exception as err:  # jinja raises on e.g. roles that do not alternate
            raise row_error(path, row_index, self.input_key,
                            f"chat template failed: {type(err).__name__}: {err}") from err
        return text


class PromptStream:
    """Deterministic, resumable batches of prompts over ``num_episodes`` passes.

    Each episode visits the dataset in the order ``permutation(seed, episode)``; with ``drop_last``
    (default, like OpenRLHF's prompt loader) a trailing partial batch is dropped so every step has
    exactly ``batch_size`` prompts. ``state_dict()`` holds the episode, the position in it and its
    order, so ``load_state_dict`` on a fresh stream continues with exactly the next batch.
    ``num_episodes`` is taken from the constructor, not the checkpoint, so a resumed run may extend it.
    """

    STATE_VERSION = 1

    def __init__(self, dataset: Sequence[Prompt], batch_size: int, seed: int = 42, num_episodes: int = 1,
                 drop_last: bool = True):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if num_episodes < 1:
            raise ValueError(f"num_episodes must be >= 1, got {num_episodes}")
        if drop_last and len(dataset) < batch_size:
            raise DataError(
                f"{len(dataset)} prompts cannot fill one batch of {batch_size}: "
                "lower rollout.rollout_batch_size or add prompt data"
            )
        self.dataset = dataset
        self.batch_size = batch_size
        self.seed = seed
        self.num_episodes = num_episodes
        self.drop_last = drop_last
        self._episode = 0
        self._position = 0  # samples consumed in this episode
        self._num_consumed = 0  # batches consumed over the whole run
        self._order: list[int] | None = None

    # -- progress -------------------------------------------------------------------------------
    @property
    def batches_per_episode(self) -> int:
        n = len(self.dataset)
        return n // self.batch_size if self.drop_last else -(-n // self.batch_size)

    @property
    def num_batches(self) -> int:
        """Batches in the whole run (all episodes)."""
        return self.num_episodes * self.batches_per_episode

    @property
    def episode(self) -> int:
        return self._episode

    @property
    def batches_consumed(self) -> int:
        return self._num_consumed

    def _episode_order(self, episode: int) -> list[int]:
        return np.random.default_rng([self.seed, episode]).permutation(len(self.dataset)).tolist()

    def _has_batch_left(self) -> bool:
        remaining = len(self.dataset) - self._position
        return remaining >= self.batch_size or (not self.drop_last and remaining > 0)

    def next_batch(self) -> list[Prompt]:
        """The next ``batch_size`` prompts; ``StopIteration`` after the last episode."""
        while not self._has_batch_left():
            if self._episode >= self.num_episodes:
                raise StopIteration
            self._episode += 1
            self._position = 0
            self._order = None
        if self._episode >= self.num_episodes:
            raise StopIteration
        if self._order is None:
            self._order = self._episode_order(self._episode)
        indices = self._order[self._position:self._position + self.batch_size]
        self._position += len(indices)
        self._num_consumed += 1
        return [self.dataset[i] for i in indices]

    def __iter__(self) -> Iterator[list[Prompt]]:
        while True:
            try:
                yield self.next_batch()
            except StopIteration:
                return

    # -- checkpointing --------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        order = self._order if self._order is not None else self._episode_order(self._episode)
        return {
            "version": self.STATE_VERSION,
            "seed": self.seed,
            "episode": self._episode,
            "position": self._position,
            "num_consumed": self._num_consumed,
            "dataset_size": len(self.dataset),
            "order": list(order),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != self.STATE_VERSION:
            raise ValueError(f"prompt stream state version {state.get('version')} != {self.STATE_VERSION}")
        if state["dataset_size"] != len(self.dataset):
            raise DataError(
                f"the prompt data changed since the checkpoint: it had {state['dataset_size']} prompts, "
                f"now {len(self.dataset)}; resume with the same data.prompt_data / max_samples / probs"
            )
        if len(state["order"]) != len(self.dataset):
            raise DataError(f"corrupt prompt stream state: order has {len(state['order'])} entries")
        # Later episodes must shuffle as the original run would: the checkpoint's seed wins.
        self.seed = int(state["seed"])
        self._episode = int(state["episode"])
        self._position = int(state["position"])
        self._num_consumed = int(state["num_consumed"])
        self._order = [int(i) for i in state["order"]]


def _special_prefix(tokenizer: Tokenizer) -> list[int]:
    """Token ids the tokenizer puts *before* a text with ``add_special_tokens=True`` (e.g. BOS).

    Suffix specials (an EOS some tokenizers append) are never wanted on a prompt, so only the prefix
    is kept.
    """
    plain = tokenizer.encode("a", add_special_tokens=False)
    full = tokenizer.encode("a", add_special_tokens=True)
    for start in range(len(full) - len(plain) + 1):
        if full[start:start + len(plain)] == plain:
            return list(full[:start])
    return []


def tokenize_prompts(tokenizer: Tokenizer, texts: Sequence[str], prompt_max_len: int) -> list[list[int]]:
    """Token ids per prompt, at most ``prompt_max_len`` each.

    * Special tokens are not doubled: a chat-templated text already starts with BOS (the template
      writes it), so the tokenizer's special prefix is added only to texts that lack it, and a
      suffix special (EOS) is never added.
    * Long prompts are truncated from the left, keeping their end (where the question and the
      generation prompt are) and the leading special prefix, if any.
    """
    if prompt_max_len < 1:
        raise ValueError(f"prompt_max_len must be >= 1, got {prompt_max_len}")
    texts = list(texts)
    if not texts:
        return []
    prefix = _special_prefix(tokenizer)
    encoded = tokenizer(texts, add_special_tokens=False)["input_ids"]
    out: list[list[int]] = []
    num_truncated = 0
    for ids in encoded:
        ids = list(ids)
        has_prefix = bool(prefix) and ids[:len(prefix)] == prefix
        if prefix and not has_prefix:
            ids = prefix + ids
            has_prefix = True
        if len(ids) > prompt_max_len:
            num_truncated += 1
            keep_prefix = has_prefix and len(prefix) < prompt_max_len
            head = prefix if keep_prefix else []
            ids = head + ids[len(ids) - (prompt_max_len - len(head)):]
        out.append(ids)
    if num_truncated:
        logger.warning("truncated %d of %d prompts to data.prompt_max_len=%d tokens (kept their end)",
                       num_truncated, len(texts), prompt_max_len)
    return out
