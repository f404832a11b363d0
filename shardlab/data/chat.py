"""Chat data: conversations rendered with the tokenizer's own chat template (the Jinja
`chat_template` of a Hugging Face tokenizer_config.json, or chat_template.jinja), and a
per-token loss mask that is 1 exactly on the assistant turns.

Rendering follows transformers' `apply_chat_template(messages, add_generation_prompt=False)`:
a sandboxed Jinja environment with trim_blocks/lstrip_blocks, `raise_exception`,
`strftime_now`, a `tojson` that does not escape HTML, loop controls, and the special tokens
of tokenizer_config.json (bos_token, eos_token, ...) as variables; the text is tokenized
without adding special tokens (the template writes them). So the ids equal transformers'.

Where the assistant turns are, two ways:
  markers  the template wraps what the model says in `{% generation %}...{% endgeneration %}`
           (transformers' `return_assistant_tokens_mask`): exact, whatever the template does.
  prefix   otherwise: for each assistant message i, the render of messages[:i] with the
           generation prompt and the render of messages[:i+1] must both be prefixes of the
           whole render; the characters between them are the turn (its text, end-of-turn
           token and what the template writes after it). A template that renders earlier
           turns differently once later ones follow (e.g. one that drops the reasoning of past
           turns) is refused, naming the conversation: add generation markers to it.
Characters map to tokens as transformers does: the tokens from the one holding a span's first
character to the one holding its last. A token straddling a span's start is counted.
"""

import importlib.util
import json
import re
from datetime import datetime
from pathlib import Path

import numpy as np

from shardlab.errors import ConfigError

MESSAGES_FIELD = "messages"
TEMPLATE_FILE, CONFIG_FILE = "chat_template.jinja", "tokenizer_config.json"
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token",
                  "mask_token")
_OPEN, _CLOSE = "\ue000", "\ue001"  # private-use characters around a {% generation %} span
_MARKERS = re.compile(r"\{%-?\s*generation\s*-?%\}")


def _environment():
  import jinja2
  import jinja2.ext
  from jinja2.sandbox import ImmutableSandboxedEnvironment

  class Generation(jinja2.ext.Extension):
    """`{% generation %}...{% endgeneration %}`: the body, between two marker characters."""
    tags = {"generation"}

    def parse(self, parser):
      lineno = next(parser.stream).lineno
      body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
      return jinja2.nodes.CallBlock(self.call_method("_mark"), [], [], body).set_lineno(lineno)

    def _mark(self, caller):
      return _OPEN + caller() + _CLOSE

  def raise_exception(message):
    raise jinja2.exceptions.TemplateError(message)

  env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                      extensions=[Generation, jinja2.ext.loopcontrols])
  env.filters["tojson"] = lambda x, ensure_ascii=False, indent=None, separators=None, \
      sort_keys=False: json.dumps(x, ensure_ascii=ensure_ascii, indent=indent,
                                  separators=separators, sort_keys=sort_keys)
  env.globals.update(raise_exception=raise_exception,
                     strftime_now=lambda fmt: datetime.now().strftime(fmt))
  return env


class ChatTemplate:
  """The chat template of a tokenizer directory, with its special tokens."""

  def __init__(self, directory: str | Path):
    directory = Path(directory)
    directory = directory.parent if directory.is_file() else directory
    config = {}
    if (directory / CONFIG_FILE).is_file():
      config = json.loads((directory / CONFIG_FILE).read_text())
    source = config.get("chat_template")
    if (directory / TEMPLATE_FILE).is_file():  # transformers 5 saves it beside the config
      source = (directory / TEMPLATE_FILE).read_text()
    if isinstance(source, list):  # named templates: the default one
      source = next((t["template"] for t in source if t.get("name") == "default"), None)
    if not isinstance(source, str):
      raise ConfigError(f"chat data needs a chat template: {directory} has no "
                        f"{TEMPLATE_FILE} and no 'chat_template' in {CONFIG_FILE}; give "
                        f"--tokenizer a Hugging Face tokenizer directory that has one")
    if importlib.util.find_spec("jinja2") is None:  # transformers depends on it
      raise ConfigError("chat data needs the 'jinja2' library: pip install jinja2")
    self.source, self.markers = source, bool(_MARKERS.search(source))
    plain = lambda v: v.get("content") if isinstance(v, dict) else v
    self.special = {k: plain(config[k]) for k in SPECIAL_TOKENS if config.get(k) is not None}
    self.template = _environment().from_string(source)

  def _render(self, messages, add_generation_prompt: bool, where: str) -> str:
    import jinja2
    try:
      return self.template.render(messages=messages, tools=None, documents=None,
                                  add_generation_prompt=add_generation_prompt, **self.special)
    except jinja2.TemplateError as e:  # the template's own raise_exception, among others
      raise ConfigError(f"{where}: the chat template refused the conversation: "
                        f"{type(e).__name__}: {e}") from None

  def render(self, messages: list[dict], where: str = "a conversation"
             ) -> tuple[str, list[tuple[int, int]]]:
    """(the rendered text, the [start, end) character spans of the assistant turns)."""
    text = self._render(messages, False, where)
    if self.markers:
      return _strip_markers(text)
    spans = []
    for i, message in enumerate(messages):
      if message.get("role") != "assistant":
        continue
      start = self._render(messages[:i], True, where)
      end = self._render(messages[:i + 1], False, where)
      if not (text.startswith(start) and text.startswith(end) and len(start) <= len(end)):
        raise ConfigError(f"{where}: the chat template renders assistant message {i} "
                          f"differently once later messages follow, so its tokens cannot "
                          f"be found by prefix; add {{% generation %}}...{{% endgeneration %}} "
                          f"around the assistant text in the template")
      spans.append((len(start), len(end)))
    return text, spans


def _strip_markers(text: str) -> tuple[str, list[tuple[int, int]]]:
  spans, out, at = [], [], 0
  for piece in re.split(f"([{_OPEN}{_CLOSE}])", text):
    if piece == _OPEN:
      start = at
    elif piece == _CLOSE:
      spans.append((start, at))
    else:
      out.append(piece)
      at += len(piece)
  return "".join(out), spans


def encode(template: ChatTemplate, tokenizer, messages: list[dict],
           where: str = "a conversation") -> tuple[np.ndarray, np.ndarray]:
  """(ids, loss mask uint8) of one conversation: the mask is 1 on its assistant tokens."""
  text, spans = template.render(_checked(messages, where), where)
  encoding = tokenizer.inner.encode(text, add_special_tokens=False)
  mask = np.zeros(len(encoding.ids), np.uint8)
  for start, end in spans:
    if end <= start:
      continue
    first, last = encoding.char_to_token(start), encoding.char_to_token(end - 1)
    if first is None:
      continue
    mask[first:len(mask) if last is None else last + 1] = 1
  return np.asarray(encoding.ids, np.int64), mask


def _checked(messages, where: str) -> list[dict]:
  if (not isinstance(messages, list) or not messages
      or not all(isinstance(m, dict) and isinstance(m.get("role"), str) for m in messages)):
    raise ConfigError(f"{where}: {MESSAGES_FIELD!r} must be a non-empty list of "
                      f"{{'role': ..., 'content': ...}} objects, got {str(messages)[:80]}")
  if not any(m["role"] == "assistant" for m in messages):
    raise ConfigError(f"{where}: the conversation has no 'assistant' message, so nothing "
                      f"in it would train; roles given: {[m['role'] for m in messages]}")
  # transformers drops keys whose value is None before rendering; so do we
  return [{k: v for k, v in m.items() if v is not None} for m in messages]


def is_chat(source: str, field: str = MESSAGES_FIELD) -> bool:
  """Whether `source` is a .jsonl file whose first record has a `field` list."""
  path = Path(source)
  if path.suffix != ".jsonl" or not path.is_file():
    return False
  with path.open(encoding="utf-8", errors="replace") as stream:
    for line in stream:
      if line.strip():
        try:
          record = json.loads(line)
        except json.JSONDecodeError:
          return False
        return isinstance(record, dict) and isinstance(record.get(field), list)
  return False


def conversations(source: str, field: str = MESSAGES_FIELD):
  """(where, messages) of each record of a .jsonl file of conversations."""
  path = Path(source)
  for n, line in enumerate(path.open(encoding="utf-8", errors="replace")):
    if not line.strip():
      continue
    where = f"{path}:{n + 1}"
    try:
      record = json.loads(line)
    except json.JSONDecodeError as e:
      raise ConfigError(f"{where} is not JSON ({e})") from None
    if not isinstance(record, dict) or field not in record:
      keys = sorted(record) if isinstance(record, dict) else type(record).__name__
      raise ConfigError(f"{where} has no conversation field {field!r} (--messages-field); "
                        f"its keys: {keys}")
    yield where, record[field]
