"""`LorafarmCallback`: ship a PEFT fine-tune from a `transformers.Trainer` (or TRL's `SFTTrainer`,
which takes the same callbacks) to a lorafarm registry, and optionally roll it out.

    from lorafarm.integrations.transformers import LorafarmCallback, RolloutPolicy

    trainer = Trainer(model=peft_model, args=args, train_dataset=..., eval_dataset=...,
                      callbacks=[LorafarmCallback(
                          tenant="acme", alias="acme/support:prod",
                          base_model_path="path/to/base",              # its hash is sent with the upload
                          rollout=RolloutPolicy(steps=(10, 50, 100), interval="5m"),
                      )])
    trainer.train()       # at the end: adapter uploaded (signed by the registry), rollout started

At train end (and, with `upload_on_save=True`, at every checkpoint) the adapter is saved as
safetensors and uploaded through `lorafarm.client.LorafarmClient` with the hash of the base it was
trained on and tags: the run name, the global step, the epoch, the latest eval metrics of the
trainer state (`eval_*`) and the last training loss, plus your `tags`. Then, at train end only:

- no `alias`: nothing else (the version is registered; deploy it later);
- `alias` and no `rollout`: the alias points at the new version at once;
- `alias` and a `rollout`: a progressive rollout of the new version on the alias, run by the
  registry (the first upload of an alias has nothing to compare with: the alias is set instead).

Only the main process uploads. The only network traffic is to the registry (`registry_url`,
default $LORAFARM_REGISTRY_URL, with `admin_token`, default $LORAFARM_ADMIN_TOKEN). Results are kept
on the callback: `uploads` (every registered version), `rollout` (the rollout started, if any).
A failed upload raises `lorafarm.client.LorafarmError` (training itself is over by then), unless
`raise_errors=False`, which logs it instead.
"""

from __future__ import annotations

import logging
import math
import os
import tempfile
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from lorafarm.client import LorafarmClient, LorafarmError, NotFoundError
from lorafarm.client.types import AdapterUploaded, Rollout, RolloutBounds

log = logging.getLogger("lorafarm.integrations.transformers")

__all__ = ["LorafarmCallback", "RolloutPolicy"]


@dataclass(frozen=True)
class RolloutPolicy:
    """How the new version is rolled out on the alias (`lorafarm aliases rollout`): the percent of
    traffic per step (the last is 100), the least time per step (seconds or "5m"), the bounds
    (`lorafarm.client.types.RolloutBounds`; registry defaults otherwise), and whether `on_train_end`
    waits for the outcome (`wait_timeout` seconds at most)."""

    steps: tuple[int, ...] = (10, 50, 100)
    interval: str | float = "5m"
    bounds: RolloutBounds | Mapping[str, Any] | None = None
    wait: bool = False
    wait_timeout: float | None = None


@dataclass
class _Result:
    uploads: list[AdapterUploaded] = field(default_factory=list)
    rollout: Rollout | None = None


def _scalar(v: Any) -> Any | None:
    """A tag value: str, bool, int, finite float (numpy and torch scalars too); None to drop."""
    if hasattr(v, "item") and callable(v.item):
        try:
            v = v.item()
        except (TypeError, ValueError):
            return None
    if isinstance(v, bool) or isinstance(v, int):
        return v
    if isinstance(v, float):
        return round(v, 6) if math.isfinite(v) else None
    if isinstance(v, str):
        return v[:256]
    return None


_THROUGHPUT = ("_runtime", "_per_second")  # eval_runtime, eval_samples_per_second: not about the model


def trainer_tags(args, state, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
    """Tags of a version from the Trainer's arguments and state: run name, step, epoch, the latest
    value of each eval metric (not the eval's runtime and throughput), the last training loss;
    `extra` wins over all of them."""
    tags: dict[str, Any] = {}
    if getattr(args, "run_name", None):
        tags["run_name"] = str(args.run_name)[:256]
    tags["global_step"] = int(getattr(state, "global_step", 0) or 0)
    if getattr(state, "epoch", None) is not None:
        tags["epoch"] = _scalar(float(state.epoch))
    for entry in getattr(state, "log_history", None) or []:
        for k, v in entry.items():
            if (k.startswith("eval_") and not k.endswith(_THROUGHPUT)) or k in ("loss", "train_loss"):
                value = _scalar(v)
                if value is not None:
                    tags[k[:64]] = value
    for k, v in (extra or {}).items():
        value = _scalar(v)
        if value is not None:
            tags[str(k)[:64]] = value
    tags = {k: v for k, v in tags.items() if v is not None}
    return dict(list(tags.items())[:64])


def _base_path_of(model) -> Path | None:
    """The local folder of the base a PEFT model was loaded from, when there is one."""
    candidates = []
    for cfg in (getattr(model, "peft_config", None) or {}).values():
        candidates.append(getattr(cfg, "base_model_name_or_path", None))
    base = getattr(model, "get_base_model", None)
    if callable(base):
        candidates.append(getattr(getattr(base(), "config", None), "_name_or_path", None))
    for c in candidates:
        if c and Path(c, "config.json").is_file():
            return Path(c)
    return None


class LorafarmCallback(TrainerCallback):
    """Upload the trained adapter to a lorafarm registry (see the module docstring)."""

    def __init__(
        self,
        tenant: str,
        *,
        alias: str | None = None,
        rollout: RolloutPolicy | None = None,
        registry_url: str | None = None,
        admin_token: str | None = None,
        base_model: str | None = None,
        base_model_hash: str | None = None,
        base_model_path: str | os.PathLike | None = None,
        tags: Mapping[str, Any] | None = None,
        upload_on_save: bool = False,
        upload_on_train_end: bool = True,
        raise_errors: bool = True,
        client: LorafarmClient | None = None,
    ):
        """`tenant`: the owning tenant. `alias`: deploy or roll out the final version there.
        `base_model` (name, or hash, as the registry serves it) picks the served base when there are
        several. The base the adapter was trained on: `base_model_hash`, else the hash of
        `base_model_path`, else of the local folder the PEFT model was loaded from."""
        if rollout is not None and not alias:
            raise ValueError("a rollout needs an alias")
        self.tenant = tenant
        self.alias = alias
        self.rollout_policy = rollout
        self.base_model = base_model
        self._base_hash = base_model_hash
        self._base_path = Path(base_model_path) if base_model_path else None
        self.extra_tags = dict(tags or {})
        self.upload_on_save = upload_on_save
        self.upload_on_train_end = upload_on_train_end
        self.raise_errors = raise_errors
        self._client = client
        self._own_client = client is None
        self._url, self._token = registry_url, admin_token
        self._result = _Result()

    # -- results ------------------------------------------------------------------------------

    @property
    def uploads(self) -> list[AdapterUploaded]:
        """Every version this callback registered, in order."""
        return list(self._result.uploads)

    @property
    def rollout(self) -> Rollout | None:
        """The rollout started at train end (its last known state when `RolloutPolicy.wait`)."""
        return self._result.rollout

    # -- plumbing -----------------------------------------------------------------------------

    def client(self) -> LorafarmClient:
        if self._client is None:
            self._client = LorafarmClient(self._url, self._token, timeout=120.0)
        return self._client

    def base_model_hash(self, model=None) -> str:
        if self._base_hash:
            return self._base_hash
        from archives.basehash import base_model_hash

        path = self._base_path or (_base_path_of(model) if model is not None else None)
        if path is None:
            raise LorafarmError(0, "LorafarmCallback: the base the adapter was trained on is unknown: pass "
                                   "base_model_hash= (`lorafarm archive basehash DIR`) or base_model_path=")
        self._base_hash = base_model_hash(path)
        return self._base_hash

    def _upload(self, folder: Path, args, state, model=None, alias: str | None = None) -> AdapterUploaded:
        tags = trainer_tags(args, state, self.extra_tags)
        out = self.client().upload_adapter(folder, self.tenant, alias=alias, base_model=self.base_model,
                                           base_model_hash=self.base_model_hash(model), tags=tags)
        self._result.uploads.append(out)
        log.info("lorafarm: uploaded %s (v%s, step %s)%s", out["adapter_id"], out["version"], tags.get("global_step"),
                 f" as {alias}" if alias else "")
        return out

    def _guard(self, what: str, fn):
        try:
            return fn()
        except LorafarmError as e:
            if self.raise_errors:
                raise
            log.error("lorafarm: %s failed: %s", what, e)
            return None

    # -- TrainerCallback ----------------------------------------------------------------------

    def on_save(self, args, state, control, **kwargs):
        if not self.upload_on_save or not state.is_world_process_zero:
            return
        folder = Path(args.output_dir) / f"checkpoint-{state.global_step}"
        if not (folder / "adapter_config.json").is_file():
            log.warning("lorafarm: %s holds no PEFT adapter (adapter_config.json); not uploaded", folder)
            return
        self._guard("upload of the checkpoint", lambda: self._upload(folder, args, state, kwargs.get("model")))

    def on_train_end(self, args, state, control, model=None, **kwargs):
        if not self.upload_on_train_end or not state.is_world_process_zero:
            return
        if model is None or not hasattr(model, "peft_config") or not hasattr(model, "save_pretrained"):
            raise LorafarmError(0, "LorafarmCallback needs a PEFT model (peft.get_peft_model) under the Trainer")
        try:
            self._guard("upload at train end", lambda: self._train_end(args, state, model))
        finally:
            if self._own_client and self._client is not None:
                self._client.close()
                self._client = None

    def _train_end(self, args, state, model) -> None:
        reg = self.client()
        deploy_now = self.alias if self.alias and self.rollout_policy is None else None
        if self.alias and self.rollout_policy is not None:
            try:
                reg.get_alias(self.alias)
            except NotFoundError:
                deploy_now = self.alias  # a first version: nothing to compare with, the alias is set
        with tempfile.TemporaryDirectory(prefix="lorafarm-adapter-") as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            out = self._upload(_adapter_folder(Path(tmp)), args, state, model, alias=deploy_now)
        if self.alias and self.rollout_policy is not None and not deploy_now:
            p = self.rollout_policy
            r = reg.start_rollout(self.alias, out["adapter_id"], steps=p.steps, interval=p.interval, bounds=p.bounds)
            log.info("lorafarm: rollout %s of %s on %s started (steps %s)", r["rollout_id"], out["adapter_id"],
                     self.alias, ",".join(map(str, r["steps"])))
            if p.wait:
                r = reg.wait_rollout(r["rollout_id"], timeout=p.wait_timeout)
                log.info("lorafarm: rollout %s %s: %s", r["rollout_id"], r["state"], r.get("reason"))
            self._result.rollout = r


def _adapter_folder(root: Path) -> Path:
    """`save_pretrained` writes the default adapter at the root, a named one in a subfolder."""
    if (root / "adapter_config.json").is_file():
        return root
    found: Iterable[Path] = sorted(root.glob("*/adapter_config.json"))
    for cfg in found:
        return cfg.parent
    raise LorafarmError(0, f"save_pretrained wrote no adapter_config.json under {root}")
