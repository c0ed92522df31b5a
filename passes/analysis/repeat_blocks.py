"""Plans for models with many identical blocks, from a capture that kept only a few of them.

Capturing Llama-2-70B's 80 decoder layers with torch.export takes ~10 s, and every layer gets the same
decisions (make_plan already decides once per repeated block). ``autopar.trace`` therefore captures a
copy whose ModuleList keeps its first blocks only, plans it, and extends the Plan and the step report
here: every entry of the *template* block is copied for each dropped block, renamed by FQN
(``model.layers.1.mlp.up_proj.weight`` -> ``model.layers.7.mlp.up_proj.weight``).

The copy is exact when the dropped blocks behave like the template. ``template_holds`` checks what it
can: the block before the template, renamed, must have the same decisions, rows and collectives.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Sequence, TypeVar

from autopar.decisions import ExpertPlan, Plan
from passes.analysis.make_plan import replicated_notes
from passes.analysis.choose_stages import ChainSegment
from passes.analysis.estimate_memory import MemoryProfile, static_memory
from passes.analysis.report import StepReport, summarize

T = TypeVar("T")


@dataclass(frozen=True, slots=True)
class Repeat:
    """One ModuleList of identical blocks that was captured with only ``template + 1`` of them."""

    prefix: str
    """FQN of the ModuleList, e.g. 'model.layers'."""
    template: int
    """The last captured block; it stands for every dropped one. Blocks before it may differ (T5's first)."""
    count: int
    """Blocks in the real model."""

    def index_of(self, name: str) -> int | None:
        """The block index ``name`` lives in, or None when it is outside this list."""
        head = self.prefix + "."
        if not name.startswith(head):
            return None
        index = name[len(head):].split(".", 1)[0]
        return int(index) if index.isdigit() else None

    def rename(self, name: str, src: int, dst: int) -> str:
        if self.index_of(name) != src:
            return name
        rest = name[len(self.prefix) + 1 + len(str(src)):]
        return f"{self.prefix}.{dst}{rest}"


# Fields holding FQNs, per record type; the first one says which block a record belongs to.
_NAME_FIELDS: dict[str, tuple[str, ...]] = {
    "MatmulPlan": ("weight", "module", "bias"),
    "ParamPlan": ("name",),
    "EmbeddingPlan": ("weight", "module"),
    "LayerRow": ("weight", "module", "bias"),
    "Collective": ("where",),
    "SegmentCost": ("name",),
    "ChainSegment": ("name",),
    "ExpertShape": ("module",),
    "AttentionShape": ("module",),
}


def _renamed(record: T, repeat: Repeat, src: int, dst: int) -> T:
    fields = _NAME_FIELDS[type(record).__name__]
    changes = {f: repeat.rename(getattr(record, f), src, dst) for f in fields if getattr(record, f)}
    return _replaced(record, changes)


def _replaced(record: T, changes: dict[str, object]) -> T:
    """``dataclasses.replace`` for the records above (frozen, slotted, no ``__post_init__``), 2.4x faster: a
    search at 16,384 GPUs renames some 200,000 of them."""
    cls = type(record)
    new = cls.__new__(cls)
    for name in cls.__slots__:
        object.__setattr__(new, name, changes[name] if name in changes else getattr(record, name))
    return new


def _block(records: Sequence[T], repeat: Repeat, index: int) -> list[T]:
    key = _NAME_FIELDS[type(records[0]).__name__][0] if records else ""
    return [r for r in records if repeat.index_of(getattr(r, key)) == index]


def _extend(records: Sequence[T], repeat: Repeat) -> tuple[T, ...]:
    """``records`` with the template block's entries copied for every dropped block.

    Each consecutive run of template entries (a block's forward collectives, later its backward
    ones) is followed by its copies, block by block: the order a capture of the whole model gives.
    """
    key = _NAME_FIELDS[type(records[0]).__name__][0] if records else ""
    out: list[T] = []
    run: list[T] = []
    for r in (*records, None):
        if r is not None and repeat.index_of(getattr(r, key)) == repeat.template:
            run.append(r)
            continue
        out.extend(run)
        if run:
            out.extend(_copies(run, repeat))
        run = []
        if r is not None:
            out.append(r)
    return tuple(out)


def _copies(run: list[T], repeat: Repeat) -> list[T]:
    """The template records ``run`` renamed for every dropped block, block by block (``_renamed`` for each,
    with each name cut around its block index once, and each record's other fields read once: a search at
    thousands of GPUs copies some 100,000 records)."""
    cls = type(run[0])
    slots = cls.__slots__
    fields = _NAME_FIELDS[cls.__name__]
    head = len(repeat.prefix) + 1
    templates = []  # per record: its field values, and (slot position, text before the index, after it) per name
    for x in run:
        values = [getattr(x, name) for name in slots]
        names = []
        for f in fields:
            name = getattr(x, f)
            if name and repeat.index_of(name) == repeat.template:
                names.append((slots.index(f), name[:head], name[head + len(str(repeat.template)):]))
        templates.append((values, names))
    out = []
    setattr_ = object.__setattr__
    for dst in range(repeat.template + 1, repeat.count):
        index = str(dst)
        for values, names in templates:
            values = list(values)
            for at, before, after in names:
                values[at] = before + index + after
            new = cls.__new__(cls)
            for name, value in zip(slots, values):
                setattr_(new, name, value)
            out.append(new)
    return out


def template_holds(plan: Plan, report: StepReport, repeat: Repeat, profile: MemoryProfile | None = None) -> bool:
    """Whether the block before the template, renamed, matches the template in every decision and cost."""
    prev, tmpl = repeat.template - 1, repeat.template
    segments = profile.segments if profile is not None else ()
    for records in (plan.matmuls, plan.params, plan.embeddings, report.layers, report.whole, report.collectives,
                    segments):
        if not records:
            continue
        before = [_renamed(r, repeat, prev, tmpl) for r in _block(records, repeat, prev)]
        if before != _block(records, repeat, tmpl):
            return False
    return True


def repeat_plan(plan: Plan, repeats: Sequence[Repeat]) -> Plan:
    matmuls, params, embeddings = plan.matmuls, plan.params, plan.embeddings
    captured = [(m.weight, m.reason) for m in matmuls if m.reason]
    captured += [(e.weight, f"(embedding) {e.reason}") for e in embeddings if e.reason]
    layouts = tuple(n for n in plan.notes if n not in replicated_notes(captured))  # (per block: they hold for all)
    experts = plan.experts
    for r in repeats:
        matmuls, params, embeddings = _extend(matmuls, r), _extend(params, r), _extend(embeddings, r)
        experts = _extend_experts(experts, r)
    why = [(m.weight, m.reason) for m in matmuls if m.reason]
    why += [(e.weight, f"(embedding) {e.reason}") for e in embeddings if e.reason]
    copied = tuple(f"{r.prefix}: blocks {r.template + 1}-{r.count - 1} planned as copies of block {r.template} "
                   f"(alike modules; blocks {r.template - 1} and {r.template} planned alike)" for r in repeats)
    return Plan(plan.config, matmuls, params, replicated_notes(why) + layouts + copied, embeddings, experts=experts,
                context_whole=plan.context_whole)  # (the captured blocks' nodes: the report copies their rows)


def _extend_experts(plans: Sequence[ExpertPlan], r: Repeat) -> tuple[ExpertPlan, ...]:
    """``plans`` with the template block's expert layers copied for every dropped block (their weights renamed)."""
    out: list[ExpertPlan] = []
    for e in plans:
        out.append(e)
        if r.index_of(e.module) == r.template:
            out += [dataclasses.replace(e, module=r.rename(e.module, r.template, d),
                                        weights=tuple(r.rename(w, r.template, d) for w in e.weights))
                    for d in range(r.template + 1, r.count)]
    return tuple(out)


def repeat_report(report: StepReport, full_plan: Plan, repeats: Sequence[Repeat], totals: bool = True
                  ) -> StepReport:
    """The report of the whole model; ``full_plan`` is ``repeat_plan``'s result. Without ``totals`` only its
    rows, collectives and parameter count are the whole model's (every total is still the cut model's): for a
    caller that summarizes them again (a pipeline's, per rank: ``autopar.planning.planner``), which saves a summary of
    some 10,000 records per plan at 16,384 GPUs."""
    rows, colls, whole, experts = report.layers, report.collectives, report.whole, report.experts
    attention = report.attention_kv
    num_parameters = report.num_parameters
    for r in repeats:
        rows, colls, whole, experts = _extend(rows, r), _extend(colls, r), _extend(whole, r), _extend(experts, r)
        attention = _extend(attention, r)
        block = sum(math.prod(p.shape) for p in full_plan.params if r.index_of(p.name) == r.template)
        num_parameters += (r.count - r.template - 1) * block
    if not totals:
        return dataclasses.replace(report, layers=rows, collectives=colls, num_parameters=num_parameters, whole=whole,
                                   experts=experts, attention_kv=attention)
    return dataclasses.replace(summarize(rows, colls, num_parameters, full_plan, whole=whole),
                               largest_param_bytes=report.largest_param_bytes, experts=experts,  # a copied block's are the cut's
                               attention_kv=attention, output_bytes=report.output_bytes)


def _renamed_segment(s: ChainSegment, r: Repeat, src: int, dst: int) -> ChainSegment:
    return dataclasses.replace(s, name=r.rename(s.name, src, dst),
                               params=tuple((r.rename(n, src, dst), b) for n, b in s.params),
                               collectives=tuple(_renamed(c, r, src, dst) for c in s.collectives))


def repeat_chain(chain: Sequence[ChainSegment], repeats: Sequence[Repeat]) -> tuple[ChainSegment, ...]:
    """The pipeline chain of the whole model. The cut after the last captured block is the cut after
    the last real one (fewer tensors cross it: masks and rotary tables stay behind); the blocks in
    between copy the block before it."""
    out = list(chain)
    for r in repeats if out else ():
        names = [x.name for x in out]
        last = next(i for i, x in enumerate(out) if r.index_of(x.name) == r.template)
        middle = out[names.index(next(n for n in names if r.index_of(n) == r.template - 1))]
        copies = [_renamed_segment(middle, r, r.template - 1, dst) for dst in range(r.template, r.count - 1)]
        final = _renamed_segment(out[last], r, r.template, r.count - 1)
        out[last:last + 1] = [*copies, final]
    return tuple(out)


def repeat_memory(profile: MemoryProfile, full_plan: Plan, repeats: Sequence[Repeat]) -> MemoryProfile:
    """The memory profile of the whole model: segments of dropped blocks copied from the template's."""
    segments, frozen = profile.segments, set(profile.frozen)
    for r in repeats:
        segments = _extend(segments, r)
        frozen |= {r.rename(name, r.template, dst) for name in profile.frozen
                   for dst in range(r.template + 1, r.count)}
    return dataclasses.replace(static_memory(segments, full_plan, tuple(sorted(frozen))),
                               output_bytes=profile.output_bytes)
