"""ServeConfig: everything that shapes the Serve application, validated once at the edge.

Made of sections (engine, replicas, autoscaling, limits, network, tenants, LoRA, tracing,
disaggregation, output parsing),
each a frozen dataclass that validates itself; ServeConfig checks what spans two of them.
A setting is declared once, as a section field (cluster/config/setting.py).

Built from the `args:` mapping of a Serve config YAML (`build_app(args)`), or from the
`kvray serve` / `kvray config` flags. That mapping is flat: its keys are the sections' field
names, which are unique across sections; unknown keys are an error so a typo in a YAML never
silently falls back to a default.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import Field, dataclass, field, fields
from typing import Any

from cluster.config.autoscaling import AutoscalingSettings
from cluster.config.engine import EngineSettings
from cluster.config.limits import LimitSettings
from cluster.config.lora import LoraSettings
from cluster.config.network import NetworkSettings
from cluster.config.parsing import ParsingSettings
from cluster.config.pd import PdSettings
from cluster.config.replicas import ReplicaSettings
from cluster.config.setting import Setting, declared
from cluster.config.tenants import TenantSettings
from cluster.config.tracing import TracingSettings


@dataclass(frozen=True)
class ServeConfig:
    """One kvray Serve application: its sections. `from_args` / `to_args` are the flat YAML
    form; `from_flat(key=value, ...)` builds one from flat keys in Python."""

    engine: EngineSettings = field(default_factory=EngineSettings)
    replicas: ReplicaSettings = field(default_factory=ReplicaSettings)
    autoscaling: AutoscalingSettings = field(default_factory=AutoscalingSettings)
    limits: LimitSettings = field(default_factory=LimitSettings)
    network: NetworkSettings = field(default_factory=NetworkSettings)
    tenants: TenantSettings = field(default_factory=TenantSettings)
    lora: LoraSettings = field(default_factory=LoraSettings)
    tracing: TracingSettings = field(default_factory=TracingSettings)
    pd: PdSettings = field(default_factory=PdSettings)
    parsing: ParsingSettings = field(default_factory=ParsingSettings)

    def __post_init__(self) -> None:
        # An adapter must not be mistaken for the model it adapts.
        self.lora.check_served(self.engine.model_name())
        if self.pd.prefill_replicas and not self.engine.kv_share_gib:
            raise ValueError(
                f"prefill_replicas needs kv_share_gib > 0 (the KV moves from a prefill to a "
                f"decode replica through the cluster KV tier), got prefill_replicas "
                f"{self.pd.prefill_replicas} with kv_share_gib {self.engine.kv_share_gib!r}"
            )

    @staticmethod
    def settings() -> Iterator[tuple[str, Field[Any], Setting]]:
        """Every setting as (section name, its field, its declaration), section by section."""
        for name, cls in SECTIONS.items():
            for f, s in declared(cls):
                yield name, f, s

    @staticmethod
    def from_flat(**settings: Any) -> ServeConfig:
        """A ServeConfig from flat keys (the YAML `args` keys); a key no section declares is
        a TypeError, like an unknown keyword."""
        unknown = sorted(set(settings) - set(SECTION_OF))
        if unknown:
            raise TypeError(f"ServeConfig has no setting {', '.join(unknown)}")
        per_section: dict[str, dict[str, Any]] = {name: {} for name in SECTIONS}
        for key, value in settings.items():
            per_section[SECTION_OF[key]][key] = value
        return ServeConfig(**{n: cls(**per_section[n]) for n, cls in SECTIONS.items()})

    @staticmethod
    def from_args(args: Mapping[str, Any] | None) -> ServeConfig:
        """Validates a YAML `args` mapping (or flags). Unknown keys raise ValueError."""
        args = dict(args or {})
        unknown = sorted(set(args) - set(SECTION_OF))
        if unknown:
            raise ValueError(
                f"unknown kvray application args: {', '.join(unknown)}; "
                f"valid keys: {', '.join(sorted(SECTION_OF))}"
            )
        return ServeConfig.from_flat(**args)

    def flat(self) -> dict[str, Any]:
        """Every setting by its flat key (None ones too)."""
        return {key: getattr(getattr(self, section), key) for key, section in SECTION_OF.items()}

    def replace(self, **settings: Any) -> ServeConfig:
        """A copy with these flat settings changed (validated again)."""
        return ServeConfig.from_flat(**(self.flat() | settings))

    def to_args(self) -> dict[str, Any]:
        """The YAML `args` mapping: every setting that is set (None ones are left out)."""
        args = {k: v for k, v in self.flat().items() if v is not None}
        if self.lora.lora_modules:  # YAML has no tuples: a list of mappings
            args["lora_modules"] = [m.to_arg() for m in self.lora.lora_modules]
        return args

    def autoscaling_config(self) -> dict[str, Any] | None:
        """Ray Serve's autoscaling_config for LLMServer, or None for a fixed replica count."""
        return self.autoscaling.serve_config(self.replicas.num_replicas)

    def engine_kwargs(self, model_dir: str) -> dict[str, Any]:
        """`EngineArgs` keyword arguments of one replica's engine (workers/config.py).

        device "auto" leaves the engine to pick (cuda if visible)."""
        e = self.engine
        return {
            "model": model_dir,
            "served_model_name": e.model_name(),
            "device": None if e.device == "auto" else e.device,
            **e.engine_args(),
            # Engines record prefix-cache events only for the router that reads them, or
            # the cluster KV tier, whose exported blocks ride with them.
            "kv_events": self.replicas.request_router == "kv_events" or e.kv_share_gib > 0,
            "kv_share": e.kv_share_gib > 0,
            **self.lora.engine_args(),
        }

    def ingress_max_in_flight(self) -> int:
        """Generation requests one HTTP ingress replica holds at once; more get 429 at the
        door (cluster/http/guard.py). What the engine replicas can take between them (each
        `max_ongoing_requests`) plus what Serve's router may queue in front of them: a request
        beyond that would be refused anyway, later and after costing the ingress its parsing."""
        r = self.replicas
        top = self.autoscaling.max_replicas
        replicas = top if top is not None else r.num_replicas
        total = (max(replicas, 1) + 1) * r.max_ongoing_requests + self.limits.max_queued_requests
        return -(-total // r.ingress_replicas)


def _section_of() -> dict[str, str]:
    """Flat key -> the section declaring it; a key declared twice is a bug caught at import."""
    out: dict[str, str] = {}
    for name, cls in SECTIONS.items():
        for f, _ in declared(cls):
            assert f.name not in out, f"setting {f.name} declared twice"
            out[f.name] = name
    return out


# Section name -> its dataclass; flat key -> its section's name.
SECTIONS: dict[str, type[Any]] = {f.name: f.default_factory for f in fields(ServeConfig)}  # type: ignore[misc]
SECTION_OF = _section_of()


def resolve_model_dir(config: ServeConfig) -> str:
    """The checkpoint directory on this node: the engine's model, or the built-in demo model."""
    if config.engine.model:
        return config.engine.model
    from workers.demo import demo_model_dir

    return str(demo_model_dir())


def resolve_tokenizer(config: ServeConfig) -> str:
    """Where the ingresses read the tokenizer: `--tokenizer`, else the model (a directory, or
    a GGUF file's embedded tokenizer: workers/tokenizer.py)."""
    return config.engine.tokenizer or resolve_model_dir(config)
