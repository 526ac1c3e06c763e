"""Structured output (response_format json_object / json_schema) by constrained decoding.

Runs in a worker process: parsers are compiled in the worker's constraint compiler process
(model_worker.constraint_process), and used inside either engine on the serve loop's thread (and, for
exllamav2, in the generator's filter threads). Owns the bridge to lm-format-enforcer: the
character-level parser built from a job's SamplingParams (a schema it cannot build is a rejected
request), a cache of compiled parsers with every regular expression's automaton built up front
(lm-format-enforcer would otherwise build one mid-generation, on the thread stepping the job), the
per-tokenizer data the enforcer needs, the per-job `JsonConstraint` the transformers engine asks
for allowed tokens, and the exllamav2 filter class. lm-format-enforcer imports torch, so nothing
here is imported by the gateway; this module imports it lazily, only when a job asks for JSON.
"""

from __future__ import annotations

import copyreg
import functools
import io
import json
import logging
import pickle
import threading
from collections import OrderedDict
from collections.abc import Iterable
from typing import Any

from model_worker.engines.base import RequestRejected
from model_worker.engines.json_schema_subset import enforceable, schemas_within
from wire.params import SamplingParams
from wire.results import RejectCode

logger = logging.getLogger(__name__)
# lm-format-enforcer logs the text generated so far at ERROR when it cannot continue; generated text
# is user content, which this project never logs above DEBUG. Our own warning says what happened.
logging.getLogger("lmformatenforcer").setLevel(logging.CRITICAL)

# json_object asks for "a JSON object", not any JSON value, as OpenAI's JSON mode does.
_ANY_OBJECT_SCHEMA: dict[str, Any] = {"type": "object"}


def wants_json(params: SamplingParams) -> bool:
    """Whether the job's output is constrained (JSON, a JSON schema, or a regular expression)."""
    return params.json_object or params.json_schema is not None or params.regex is not None


# Compiled parsers, by what they enforce. A parser is immutable (each character makes a new one),
# so jobs share it; most services send the same few schemas over and over.
_COMPILED: OrderedDict[tuple[Any, ...], Any] = OrderedDict()
_COMPILED_LOCK = threading.Lock()
MAX_COMPILED = 128


def constraint_key(params: SamplingParams) -> tuple[Any, ...]:
    return (params.json_object, params.json_schema, params.regex, params.compact_json)


def is_compiled(params: SamplingParams) -> bool:
    with _COMPILED_LOCK:
        return constraint_key(params) in _COMPILED


def build_parser(params: SamplingParams) -> Any:
    """The job's parser: compiled already (the usual case, by model_worker.constraints), or now."""
    key = constraint_key(params)
    with _COMPILED_LOCK:
        parser = _COMPILED.get(key)
        if parser is not None:
            _COMPILED.move_to_end(key)
            return parser
    return compile_parser(params)


def compile_parser(params: SamplingParams) -> Any:
    """Build the parser and every automaton it will need, and cache it; RequestRejected if the
    schema or expression cannot be enforced."""
    parser = _new_parser(params)
    context = getattr(parser, "context", None)
    if context is not None and hasattr(context, "regex_parser_cache"):
        # The library's cache is a dict on its context class, which pickling leaves behind: built in
        # the compiler's process, the automata reached the worker only as a rebuild mid-step.
        context.regex_parser_cache = {}
    for pattern in _schema_patterns(params):
        _build_pattern(parser, pattern)
    remember_parser(params, parser)
    return parser


def dumps_parser(parser: Any) -> bytes:
    """A compiled parser as bytes for the worker, its automata included.

    interegular marks "any other character" with one module-level object that automata compare by
    identity; pickled by value it would come back as a stranger, and every automaton with a negated
    class would fail in the worker. It travels as a reference to that object instead."""
    from interegular.fsm import _AnythingElseCls

    buffer = io.BytesIO()
    pickler = pickle.Pickler(buffer, protocol=pickle.HIGHEST_PROTOCOL)
    pickler.dispatch_table = {**copyreg.dispatch_table, _AnythingElseCls: lambda _: "anything_else"}
    pickler.dump(parser)
    return buffer.getvalue()


def remember_parser(params: SamplingParams, parser: Any) -> None:
    """Cache a parser compiled elsewhere (the constraint compiler's process) for jobs to use."""
    _fix_json_parser()  # the fixes patch classes: the process that steps the parser needs them too
    with _COMPILED_LOCK:
        _COMPILED[constraint_key(params)] = parser
        while len(_COMPILED) > MAX_COMPILED:
            _COMPILED.popitem(last=False)


def patterns_of(params: SamplingParams) -> list[str]:
    """Every regular expression the job's constraint holds (its own, or its schema's patterns)."""
    return ([params.regex] if params.regex is not None else []) + _schema_patterns(params)


def _schema_patterns(params: SamplingParams) -> list[str]:
    if params.json_schema is None:
        return []
    found: list[str] = []

    def walk(node: Any) -> None:
        if isinstance(node, dict):
            pattern = node.get("pattern")
            if isinstance(pattern, str):
                found.append(pattern)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    try:
        walk(json.loads(params.json_schema))
    except ValueError:
        return []
    return found


def _build_pattern(parser: Any, pattern: str) -> None:
    """Put a schema pattern's automaton where lm-format-enforcer looks for it (its root context's
    regex cache, keyed as it strips anchors), so no generation step ever builds one."""
    from lmformatenforcer import RegexParser

    context = getattr(parser, "context", None)
    cache = getattr(context, "regex_parser_cache", None)
    if cache is None:
        return
    key = pattern[1:] if pattern.startswith("^") else pattern
    key = key[:-1] if key.endswith("$") else key
    if key not in cache:
        try:
            cache[key] = RegexParser(key, parser.config)
        except Exception as exc:  # interegular raises its own types for what it cannot compile
            raise _invalid(
                f"the schema's pattern {pattern[:80]!r} cannot be enforced: {_first_line(exc)}"
            ) from None


def _new_parser(params: SamplingParams) -> Any:
    from lmformatenforcer import CharacterLevelParserConfig, JsonSchemaParser, RegexParser

    if params.regex is not None:
        try:
            return RegexParser(params.regex)
        except Exception as exc:  # interegular raises its own types for what it cannot compile
            raise RequestRejected(
                RejectCode.INVALID_RESPONSE_FORMAT,
                f"the regular expression cannot be enforced: {_first_line(exc)}",
                "regex",
            ) from None
    from lmformatenforcer import jsonschemaparser as lmfe
    from lmformatenforcer.external.jsonschemaobject import JsonSchemaObject

    _fix_json_parser()
    schema = _ANY_OBJECT_SCHEMA
    if params.json_schema is not None:
        try:
            schema = json.loads(params.json_schema)
        except ValueError:
            raise _invalid("json_schema.schema is not valid JSON") from None
        if not isinstance(schema, dict):
            raise _invalid("json_schema.schema must be a JSON object")
    try:
        schema = enforceable(schema)
    except ValueError as exc:
        raise _invalid(f"the JSON schema cannot be enforced: {exc}") from None
    # Required keys in the schema's order, as OpenAI, xgrammar and llguidance write them: a cut tool
    # call then always has its name before its arguments.
    config = CharacterLevelParserConfig(force_json_field_order=True)
    if params.compact_json:
        config.max_consecutive_whitespaces = 0
    try:
        parser = JsonSchemaParser(schema, config=config)
        parser.kept_config = (config.max_consecutive_whitespaces, True)
        # The enforcer builds a value's parser only when generation reaches it; build each once now,
        # so that what it cannot build is a refusal, not a job that ends in broken JSON.
        for node in schemas_within(schema):
            lmfe.get_parser(parser, JsonSchemaObject(**node))
        return parser
    except Exception as exc:  # pydantic and lm-format-enforcer raise many types for a bad schema
        raise _invalid(f"the JSON schema cannot be enforced: {_first_line(exc)}") from None


@functools.cache
def _fix_json_parser() -> None:
    """Fix four lm-format-enforcer 0.11.3 parser bugs that let invalid output through. Once per process.

    Patched on the classes, because the library builds its parser states itself. The fixes only
    remove wrong outcomes; tests/unit/test_structured_output.py pins them.
    - An object may close right after a comma (`{"a": 1,}`), which no JSON parser accepts: `}` is
      allowed whenever the required keys are present. After `,` another key is always allowed, so
      forbidding `}` there leaves no dead end.
    - Whitespace right after a string's opening quote is dropped as if it stood between tokens, so
      `" abc"` counts as three characters against maxLength (and enum values starting with a space
      cannot be written). Inside the quotes it is part of the string.
    - An integer may take a fraction or an exponent (`-0.5`, `2e-3`, `1e999`): only digits are kept.
    - An enum of booleans is written `True`, one of mixed types or a non-string const fails: every
      enum value is written as its own JSON text (json_schema_subset turns a const into an enum).
    """
    from lmformatenforcer import UnionParser
    from lmformatenforcer import jsonschemaparser as lmfe

    object_class, key_or_end = lmfe.ObjectParsingState, lmfe.ObjectParsingStage.PARSING_KEY_OR_END
    object_allowed = object_class.get_allowed_characters

    def get_allowed_characters(self: Any) -> str:
        allowed = str(object_allowed(self))
        # existing_keys is empty right after `{`, where `{}` is fine, and never empty after a `,`.
        return (
            allowed.replace("}", "") if self.current_stage == key_or_end and self.existing_keys else allowed
        )

    string_class = lmfe.StringParsingState
    string_add = string_class.add_character

    def add_character(self: Any, character: str) -> Any:
        opened = self.require_opening_quote and self.seen_opening_quote and not self.seen_closing_quote
        if opened and not self.parsed_string and character in lmfe.WHITESPACE_CHARACTERS:
            updated = self._clone()  # what the library does for any other character in a string
            updated.parsed_string = character
            if updated.regex_parser is not None:
                updated.regex_parser = updated.regex_parser.add_character(character)
            return updated
        return string_add(self, character)

    number_class = lmfe.NumberParsingState
    number_allowed = number_class.get_allowed_characters

    def number_allowed_characters(self: Any) -> str:
        allowed = str(number_allowed(self))
        return allowed if self.allow_floating_point else allowed.translate(_NO_FRACTION)

    library_get_parser = lmfe.get_parser

    def get_parser(state: Any, value_schema: Any) -> Any:
        values = value_schema.enum if value_schema is not None and not value_schema.anyOf else None
        if not values:
            return library_get_parser(state, value_schema)
        # Each value written exactly as its JSON text; strings as their text between the quotes.
        texts = [json.dumps(v, ensure_ascii=False) for v in values]
        strings = [t[1:-1] for t in texts if t.startswith('"')]
        others = [t for t in texts if not t.startswith('"')]
        options = [string_class(state, strings, require_opening_quote=True)] if strings else []
        if others:
            options.append(
                string_class(state, others, require_opening_quote=False, require_closing_quote=False)
            )
        return options[0] if len(options) == 1 else UnionParser(options)

    object_class.get_allowed_characters = get_allowed_characters
    string_class.add_character = add_character
    number_class.get_allowed_characters = number_allowed_characters
    lmfe.get_parser = get_parser


_NO_FRACTION = str.maketrans("", "", ".eE")


def _invalid(message: str) -> RequestRejected:
    return RequestRejected(RejectCode.INVALID_RESPONSE_FORMAT, message, "response_format")


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    return (text[0] if text else type(exc).__name__)[:200]


def transformers_tokenizer_data(tokenizer: Any, vocab_size: int, end_ids: Iterable[int]) -> Any:
    """lm-format-enforcer's per-tokenizer data for a Hugging Face tokenizer; slow (decodes the vocabulary).

    This is what `lmformatenforcer.integrations.transformers.build_token_enforcer_tokenizer_data`
    does, rebuilt here because that module does not import under transformers >= 5 (it imports
    `transformers.tokenization_utils`, which is gone). Every end id the engine stops on is passed,
    so that the enforcer may close the output with any of them.
    """
    # all_special_ids misses added special tokens such as a chat template's <|im_start|>: the model
    # could write them into a string, and the engine (which skips special tokens) would not show them.
    special = set(tokenizer.all_special_ids)
    special.update(i for i, added in tokenizer.added_tokens_decoder.items() if added.special)
    # A token's text after a digit tells whether it starts a word (a leading space the tokenizer
    # drops when the token stands alone).
    zero = tokenizer.encode("0", add_special_tokens=False)[-1]
    regular: list[tuple[int, str, bool]] = []
    for token_id in range(vocab_size):
        if token_id in special:
            continue
        after_zero = tokenizer.decode([zero, token_id])[1:]
        alone = tokenizer.decode([token_id])
        regular.append((token_id, after_zero, len(after_zero) > len(alone)))

    def decode(token_ids: list[int]) -> str:
        # A trailing partial UTF-8 sequence decodes to U+FFFD; the enforcer must not see it as text.
        return str(tokenizer.decode(token_ids)).rstrip("\ufffd")

    return _json_safe(regular, decode, sorted(set(end_ids)), vocab_size)


def exllamav2_tokenizer_data(tokenizer: Any) -> Any:
    """The same for an exllamav2 tokenizer, from lm-format-enforcer's own exllamav2 integration."""
    from lmformatenforcer.integrations.exllamav2 import build_token_enforcer_tokenizer_data

    data = build_token_enforcer_tokenizer_data(tokenizer)
    return _json_safe(data.regular_tokens, data.decoder, data.eos_token_id, data.vocab_size)


def _json_safe(
    regular: list[tuple[int, str, bool]], decode: Any, end_ids: int | list[int], vocab_size: int
) -> Any:
    """Tokenizer data restricted to tokens that cannot break the JSON the enforcer believes it made.

    Left out: tokens that decode to nothing (the enforcer allows those everywhere, and a job could
    emit them forever), tokens that are part of a UTF-8 sequence (they decode to U+FFFD alone, so
    the enforcer's idea of the text drifts from the real text), and tokens holding control
    characters other than whitespace (never valid in JSON). The model can still write any
    character: whole-character tokens, or a \\u escape. And the table of tokens allowed inside
    strings is rebuilt without tabs: lm-format-enforcer checks newlines there but lets a raw tab
    through, and JSON forbids raw control characters in strings.
    """
    from lmformatenforcer import TokenEnforcerTokenizerData
    from lmformatenforcer.tokenizerprefixtree import JsonFreetextTokenCache

    kept = [entry for entry in regular if _clean(entry[1])]
    data = TokenEnforcerTokenizerData(kept, decode, end_ids, False, vocab_size)
    in_strings = JsonFreetextTokenCache(False, vocab_size)
    for token_id, text, _ in kept:
        if "\t" not in text:
            in_strings.add_token(text, token_id)
    in_strings.freeze()
    data.tokenizer_tree.json_freetext_tokens = in_strings
    return data


def _clean(text: str) -> bool:
    return bool(text) and "\ufffd" not in text and all(c in "\t\n\r" or c >= " " for c in text)


class JsonConstraint:
    """One transformers job's enforcer: which tokens may come next, given the completion so far."""

    def __init__(self, tokenizer_data: Any, parser: Any, rid: str) -> None:
        from lmformatenforcer import TokenEnforcer

        self.enforcer = TokenEnforcer(tokenizer_data, parser)
        _keep_config(parser)
        eos = tokenizer_data.eos_token_id
        self.end_ids: list[int] = list(eos) if isinstance(eos, list) else [eos]
        self.rid = rid
        _check_start(self.enforcer)

    def allowed(self, generated: list[int]) -> list[int]:
        """Allowed next token ids after `generated` (the completion's ids only, not the prompt's)."""
        try:
            allowed = list(self.enforcer.get_allowed_tokens(generated).allowed_tokens)
        except Exception as exc:
            # A schema feature that fails only once generation reaches it (lm-format-enforcer builds
            # nested parsers lazily). The job cannot continue within the schema: end it.
            logger.warning("rid=%s structured output stopped: %s", self.rid, _first_line(exc))
            return self.end_ids
        _forget_before(self.enforcer, generated)
        return allowed

    def end_in(self, allowed: list[int]) -> int | None:
        """An end id when the output may end here; like exllamav2's filter_prefer_eos, it then ends."""
        permitted = set(allowed)
        return next((t for t in self.end_ids if t in permitted), None)


def exllamav2_filter(parser: Any, tokenizer_data: Any) -> Any:
    """A per-job exllamav2 filter that enforces `parser`; RequestRejected if it cannot even start."""
    job_filter = _exllamav2_filter_class()(parser, tokenizer_data)
    _keep_config(parser)
    _check_start(job_filter.token_enforcer)
    return job_filter


def _keep_config(parser: Any) -> None:
    """lm-format-enforcer's TokenEnforcer replaces its parser's config with a default one (keeping
    only the alphabet); put the job's whitespace limit (compact_json) and key order back."""
    kept = getattr(parser, "kept_config", None)
    if kept is not None:
        parser.config.max_consecutive_whitespaces, parser.config.force_json_field_order = kept


def _forget_before(enforcer: Any, sequence: list[int]) -> None:
    """Drop the enforcer's state for the prefix before `sequence`, now that `sequence` has its own.

    The enforcer keeps a state per prefix it has seen, for beam search, which is quadratic memory
    in the output length; one job only ever extends its newest prefix, so older states are dead.
    """
    if sequence:
        enforcer.prefix_states.pop(tuple(sequence[:-1]), None)


def _check_start(enforcer: Any) -> None:
    """Compute the first step's allowed tokens now, so that a schema failing there is a rejection."""
    try:
        enforcer.get_allowed_tokens([])
    except Exception as exc:
        raise _invalid(f"the JSON schema cannot be enforced: {_first_line(exc)}") from None


@functools.cache
def _exllamav2_filter_class() -> type:
    """lm-format-enforcer's filter, made a real `ExLlamaV2Filter`.

    lm-format-enforcer 0.11.3's `ExLlamaV2TokenEnforcerFilter` does not subclass `ExLlamaV2Filter`,
    and exllamav2 0.3.2's dynamic generator calls base-class methods on every filter
    (`background_drop`, `can_mask_logits`, `use_background_worker`, `get_next`): used as is it fails
    with AttributeError (exllamav2 issues #696, #709). The base class supplies those methods; the
    enforcer filter keeps `begin`, `feed`, `next` and `clone`, which come first in the MRO.
    """
    from exllamav2.generator.filters import ExLlamaV2Filter
    from lmformatenforcer.integrations.exllamav2 import ExLlamaV2TokenEnforcerFilter

    class TokenEnforcerFilter(ExLlamaV2TokenEnforcerFilter, ExLlamaV2Filter):
        def __init__(self, parser: Any, tokenizer_data: Any) -> None:
            # The enforcer filter never uses model or tokenizer; the base class only stores them.
            ExLlamaV2Filter.__init__(self, None, None)
            ExLlamaV2TokenEnforcerFilter.__init__(self, parser, tokenizer_data)

        def next(self) -> Any:
            allowed = super().next()
            _forget_before(self.token_enforcer, self.token_sequence)
            return allowed

        def use_background_worker(self) -> bool:
            # The enforcer is CPU work: let the generator run next() while the GPU runs the forward
            # pass. Each job has its own filter, and a filter's state is touched by one thread at a time.
            return True

    return TokenEnforcerFilter
