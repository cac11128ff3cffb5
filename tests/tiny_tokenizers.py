"""Tiny offline tokenizers that carry real chat templates, for tests.

``make_tokenizer(template)`` returns a ``transformers.PreTrainedTokenizerFast`` built in-process with the
``tokenizers`` library: a byte-level BPE trained on a few hundred characters (deterministic), plus the
template's special tokens, with ``chat_template`` set to a verbatim copy of the real model's template and
bos/eos set the way the real model's ``tokenizer_config.json`` sets them.

Every id is < ``VOCAB_LIMIT`` (512), so the tokenizers can drive tiny random models with vocab 512.

Templates (copied verbatim; only whitespace that Jinja outputs nowhere differs, if at all):

* ``chatml``   - HuggingFaceTB/SmolLM2-*-Instruct (ChatML with SmolLM's default system prompt when the
  conversation has none). bos ``<|im_start|>``, eos ``<|im_end|>``.
* ``llama3``   - meta-llama/Llama-3.1-8B-Instruct (system block with "Cutting Knowledge Date" / "Today Date:
  26 Jul 2024", contents ``| trim``-ed). bos ``<|begin_of_text|>``, eos ``<|eot_id|>``.
* ``deepseek`` - deepseek-ai/DeepSeek-V3 (original release; system prompt right after BOS, no role
  separators). bos ``<｜begin▁of▁sentence｜>``, eos ``<｜end▁of▁sentence｜>``.
* ``kimi``     - moonshotai/Kimi-K2-Instruct (as first released; copy kept in llama.cpp as
  ``models/templates/moonshotai-Kimi-K2.jinja``). bos ``[BOS]``, eos ``[EOS]`` -- like the real model, the
  eos token is *not* the end-of-turn token ``<|im_end|>``.

The trained BPE model is cached per template within the process; every call returns a fresh wrapper, so a
test that mutates its tokenizer cannot leak into another test.
"""

from __future__ import annotations

import functools
import os
import re

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

VOCAB_LIMIT = 512

# --------------------------------------------------------------------------------------------------------
# Chat templates (Jinja source exactly as in the models' tokenizer_config.json, i.e. "\n" inside Jinja string
# literals is the two characters backslash + n, which Jinja turns into a newline).
# --------------------------------------------------------------------------------------------------------

SMOLLM2_TEMPLATE = (
    r"""{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}{{ '<|im_start|>system
You are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>
' }}{% endif %}{{'<|im_start|>' + message['role'] + '
' + message['content'] + '<|im_end|>' + '
'}}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant
' }}{% endif %}"""
)

LLAMA31_TEMPLATE = r"""{{- bos_token }}
{%- if custom_tools is defined %}
    {%- set tools = custom_tools %}
{%- endif %}
{%- if not tools_in_user_message is defined %}
    {%- set tools_in_user_message = true %}
{%- endif %}
{%- if not date_string is defined %}
    {%- set date_string = "26 Jul 2024" %}
{%- endif %}
{%- if not tools is defined %}
    {%- set tools = none %}
{%- endif %}

{#- This block extracts the system message, so we can slot it into the right place. #}
{%- if messages[0]['role'] == 'system' %}
    {%- set system_message = messages[0]['content']|trim %}
    {%- set messages = messages[1:] %}
{%- else %}
    {%- set system_message = "" %}
{%- endif %}

{#- System message + builtin tools #}
{{- "<|start_header_id|>system<|end_header_id|>\n\n" }}
{%- if builtin_tools is defined or tools is not none %}
    {{- "Environment: ipython\n" }}
{%- endif %}
{%- if builtin_tools is defined %}
    {{- "Tools: " + builtin_tools | reject('equalto', 'code_interpreter') | join(", ") + "\n\n"}}
{%- endif %}
{{- "Cutting Knowledge Date: December 2023\n" }}
{{- "Today Date: " + date_string + "\n\n" }}
{%- if tools is not none and not tools_in_user_message %}
    {{- "You have access to the following functions. To call a function, please respond with JSON for a function call." }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
{%- endif %}
{{- system_message }}
{{- "<|eot_id|>" }}

{#- Custom tools are passed in a user message with some extra guidance #}
{%- if tools_in_user_message and not tools is none %}
    {#- Extract the first user message so we can plug it in here #}
    {%- if messages | length != 0 %}
        {%- set first_user_message = messages[0]['content']|trim %}
        {%- set messages = messages[1:] %}
    {%- else %}
        {{- raise_exception("Cannot put tools in the first user message when there's no first user message!") }}
{%- endif %}
    {{- '<|start_header_id|>user<|end_header_id|>\n\n' -}}
    {{- "Given the following functions, please respond with a JSON for a function call " }}
    {{- "with its proper arguments that best answers the given prompt.\n\n" }}
    {{- 'Respond in the format {"name": function name, "parameters": dictionary of argument name and its value}.' }}
    {{- "Do not use variables.\n\n" }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- "\n\n" }}
    {%- endfor %}
    {{- first_user_message + "<|eot_id|>"}}
{%- endif %}

{%- for message in messages %}
    {%- if not (message.role == 'ipython' or message.role == 'tool' or 'tool_calls' in message) %}
        {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'+ message['content'] | trim + '<|eot_id|>' }}
    {%- elif 'tool_calls' in message %}
        {%- if not message.tool_calls|length == 1 %}
            {{- raise_exception("This model only supports single tool-calls at once!") }}
        {%- endif %}
        {%- set tool_call = message.tool_calls[0].function %}
        {%- if builtin_tools is defined and tool_call.name in builtin_tools %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- "<|python_tag|>" + tool_call.name + ".call(" }}
            {%- for arg_name, arg_val in tool_call.arguments | items %}
                {{- arg_name + '="' + arg_val + '"' }}
                {%- if not loop.last %}
                    {{- ", " }}
                {%- endif %}
                {%- endfor %}
            {{- ")" }}
        {%- else  %}
            {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
            {{- '{"name": "' + tool_call.name + '", ' }}
            {{- '"parameters": ' }}
            {{- tool_call.arguments | tojson }}
            {{- "}" }}
        {%- endif %}
        {%- if builtin_tools is defined %}
            {#- This means we're in ipython mode #}
            {{- "<|eom_id|>" }}
        {%- else %}
            {{- "<|eot_id|>" }}
        {%- endif %}
    {%- elif message.role == "tool" or message.role == "ipython" %}
        {{- "<|start_header_id|>ipython<|end_header_id|>\n\n" }}
        {%- if message.content is mapping or message.content is iterable %}
            {{- message.content | tojson }}
        {%- else %}
            {{- message.content }}
        {%- endif %}
        {{- "<|eot_id|>" }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' }}
{%- endif %}
"""

DEEPSEEK_V3_TEMPLATE = (
    r"""{% if not add_generation_prompt is defined %}{% set add_generation_prompt = false %}{% endif %}"""
    r"""{% set ns = namespace(is_first=false, is_tool=false, is_output_first=true, system_prompt='', is_first_sp=true) %}"""
    r"""{%- for message in messages %}{%- if message['role'] == 'system' %}{%- if ns.is_first_sp %}"""
    r"""{% set ns.system_prompt = ns.system_prompt + message['content'] %}{% set ns.is_first_sp = false %}"""
    r"""{%- else %}{% set ns.system_prompt = ns.system_prompt + '\n\n' + message['content'] %}{%- endif %}"""
    r"""{%- endif %}{%- endfor %}{{bos_token}}{{ns.system_prompt}}{%- for message in messages %}"""
    r"""{%- if message['role'] == 'user' %}{%- set ns.is_tool = false -%}{{'<｜User｜>' + message['content']}}{%- endif %}"""
    r"""{%- if message['role'] == 'assistant' and message['content'] is none %}{%- set ns.is_tool = false -%}"""
    r"""{%- for tool in message['tool_calls']%}{%- if not ns.is_first %}"""
    r"""{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}"""
    r"""{%- set ns.is_first = true -%}{%- else %}"""
    r"""{{'\n' + '<｜tool▁call▁begin｜>' + tool['type'] + '<｜tool▁sep｜>' + tool['function']['name'] + '\n' + '```json' + '\n' + tool['function']['arguments'] + '\n' + '```' + '<｜tool▁call▁end｜>'}}"""
    r"""{{'<｜tool▁calls▁end｜><｜end▁of▁sentence｜>'}}{%- endif %}{%- endfor %}{%- endif %}"""
    r"""{%- if message['role'] == 'assistant' and message['content'] is not none %}{%- if ns.is_tool %}"""
    r"""{{'<｜tool▁outputs▁end｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- set ns.is_tool = false -%}"""
    r"""{%- else %}{{'<｜Assistant｜>' + message['content'] + '<｜end▁of▁sentence｜>'}}{%- endif %}{%- endif %}"""
    r"""{%- if message['role'] == 'tool' %}{%- set ns.is_tool = true -%}{%- if ns.is_output_first %}"""
    r"""{{'<｜tool▁outputs▁begin｜><｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}"""
    r"""{%- set ns.is_output_first = false %}{%- else %}"""
    r"""{{'\n<｜tool▁output▁begin｜>' + message['content'] + '<｜tool▁output▁end｜>'}}{%- endif %}{%- endif %}"""
    r"""{%- endfor -%}{% if ns.is_tool %}{{'<｜tool▁outputs▁end｜>'}}{% endif %}"""
    r"""{% if add_generation_prompt and not ns.is_tool %}{{'<｜Assistant｜>'}}{% endif %}"""
)

KIMI_K2_TEMPLATE = r"""{% if tools -%}
    {{ '<|im_system|>tool_declare<|im_middle|>' -}}
    {{- tools | tojson -}}
    {{ '<|im_end|>' -}}
{%- endif -%}

{%- for message in messages -%}
  {%- if loop.first and messages[0]['role'] != 'system' -%}
    {{ '<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>' }}
  {%- endif -%}
  {%- if message['role'] == 'system' -%}
    {{ '<|im_system|>system<|im_middle|>' }}
  {%- elif message['role'] == 'user' -%}
    {{ '<|im_user|>user<|im_middle|>' }}
  {%- elif message['role'] == 'assistant' -%}
    {{ '<|im_assistant|>assistant<|im_middle|>' }}
  {%- elif message['role'] == 'tool' -%}
    {{ '<|im_system|>tool<|im_middle|>' }}
  {%- endif -%}

  {%- if message['content'] is string -%}
    {{- message['content'] + '<|im_end|>' -}}
  {%- else -%}
    {%- for content in message['content'] -%}
      {%- if content['type'] == 'image' or 'image' in content or 'image_url' in content -%}
        {{ '<|media_start|>image<|media_content|><|media_pad|><|media_end|>' }}
      {%- else -%}
        {{ content['text'] }}
      {%- endif -%}
    {%- endfor -%}
    {{ '<|im_end|>' }}
  {%- endif -%}
{%- endfor -%}

{%- if add_generation_prompt -%}
  {{ '<|im_assistant|>assistant<|im_middle|>' }}
{%- endif -%}"""

# --------------------------------------------------------------------------------------------------------
# Per-template special tokens: (content, special).  Ids are assigned in this order, starting at 0.
# --------------------------------------------------------------------------------------------------------

_SPECS: dict[str, dict] = {
    "chatml": {
        "template": SMOLLM2_TEMPLATE,
        "added": [("<|endoftext|>", True), ("<|im_start|>", True), ("<|im_end|>", True)],
        "roles": {"bos_token": "<|im_start|>", "eos_token": "<|im_end|>", "pad_token": "<|im_end|>",
                  "unk_token": "<|endoftext|>"},
    },
    "llama3": {
        "template": LLAMA31_TEMPLATE,
        "added": [("<|begin_of_text|>", True), ("<|end_of_text|>", True), ("<|start_header_id|>", True),
                  ("<|end_header_id|>", True), ("<|eom_id|>", True), ("<|eot_id|>", True),
                  ("<|python_tag|>", True)],
        "roles": {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"},
    },
    "deepseek": {
        "template": DEEPSEEK_V3_TEMPLATE,
        "added": [("<｜begin▁of▁sentence｜>", True), ("<｜end▁of▁sentence｜>", True), ("<｜▁pad▁｜>", True),
                  ("<｜User｜>", False), ("<｜Assistant｜>", False),
                  ("<｜tool▁calls▁begin｜>", False), ("<｜tool▁calls▁end｜>", False),
                  ("<｜tool▁call▁begin｜>", False), ("<｜tool▁call▁end｜>", False),
                  ("<｜tool▁outputs▁begin｜>", False), ("<｜tool▁outputs▁end｜>", False),
                  ("<｜tool▁output▁begin｜>", False), ("<｜tool▁output▁end｜>", False),
                  ("<｜tool▁sep｜>", False)],
        "roles": {"bos_token": "<｜begin▁of▁sentence｜>", "eos_token": "<｜end▁of▁sentence｜>",
                  "pad_token": "<｜▁pad▁｜>"},
    },
    "kimi": {
        "template": KIMI_K2_TEMPLATE,
        "added": [("[BOS]", True), ("[EOS]", True), ("[UNK]", True), ("[PAD]", True),
                  ("<|im_end|>", True), ("<|im_user|>", True), ("<|im_assistant|>", True),
                  ("<|im_system|>", True), ("<|im_middle|>", True),
                  ("<|media_start|>", True), ("<|media_content|>", True), ("<|media_end|>", True),
                  ("<|media_pad|>", True)],
        "roles": {"bos_token": "[BOS]", "eos_token": "[EOS]", "unk_token": "[UNK]", "pad_token": "[PAD]"},
    },
}

TEMPLATES = tuple(_SPECS)

# A few hundred characters of training text: the words the tests use, so BPE learns multi-character tokens
# (token boundaries then matter for the loss mask) while staying tiny.
_CORPUS = [
    "You are a helpful assistant. You are a helpful AI assistant named SmolLM, trained by Hugging Face.",
    "Hi! Hello there! How are you? I am fine, thank you. Thanks, bye. Bye! Goodbye and have a nice day.",
    "What is the capital of France? The capital of France is Paris. Tell me a joke about cats and dogs.",
    "Cutting Knowledge Date: December 2023\nToday Date: 26 Jul 2024\n\n",
    "system user assistant tool_declare image text content role messages conversation answer question",
    "The quick brown fox jumps over the lazy dog. 0123456789 + - * / = ( ) [ ] { } < > | , . ; : ' \"",
]


@functools.lru_cache(maxsize=None)
def _tokenizer_json(template: str) -> str:
    spec = _SPECS[template]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    specials = [AddedToken(s, special=sp, normalized=False) for s, sp in spec["added"]]
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_LIMIT,
        min_frequency=2,
        show_progress=False,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(_CORPUS * 4, trainer=trainer)
    # train_from_iterator registers the special tokens; make sure the `special` flags are the intended ones.
    tok.add_special_tokens([t for t in specials if t.special])
    tok.add_tokens([t for t in specials if not t.special])
    return tok.to_str()


def make_tokenizer(template: str) -> PreTrainedTokenizerFast:
    """A fresh tiny fast tokenizer carrying the real chat template named ``template``."""
    if template not in _SPECS:
        raise ValueError(f"unknown template {template!r}; choose from {sorted(_SPECS)}")
    spec = _SPECS[template]
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=Tokenizer.from_str(_tokenizer_json(template)),
        clean_up_tokenization_spaces=False,
        model_max_length=1 << 20,
        **spec["roles"],
    )
    tokenizer.chat_template = spec["template"]
    assert len(tokenizer) <= VOCAB_LIMIT, (template, len(tokenizer))
    return tokenizer


def make_word_tokenizer(extra_words=()) -> PreTrainedTokenizerFast:
    """A ChatML tokenizer whose tokens are whole words and punctuation (WordLevel), so decode -> encode gives back
    the same ids: text written from a model's own generations re-tokenizes to exactly those generations."""
    lines = _CORPUS + [SMOLLM2_TEMPLATE] + list(extra_words)
    words = sorted({w for line in lines for w in re.findall(r"\w+|[^\w\s]", line)})
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {t: i for i, t in enumerate(specials + words[: VOCAB_LIMIT - len(specials)])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.add_special_tokens([AddedToken(s, special=True, normalized=False) for s in specials])
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, clean_up_tokenization_spaces=False,
                                        model_max_length=1 << 20, **_SPECS["chatml"]["roles"])
    tokenizer.chat_template = SMOLLM2_TEMPLATE
    return tokenizer


def make_slow_tokenizer(template: str, kind: str = "python"):
    """The slow (no offsets) twin of ``make_tokenizer(template)``: same vocab, merges, special tokens and chat
    template, in the shape of Kimi-K2.5's tiktoken-based ``TikTokenTokenizer``. kind "python": BPE in Python over
    the tokenizer.json (tests/slow_tokenizer.py); "tiktoken": a tiktoken.model run by the tiktoken package
    (tests/tiktoken_tokenizer.py, written to a temporary file)."""
    fast = make_tokenizer(template)
    if kind == "python":
        from slow_tokenizer import SlowByteLevelBPE
        tokenizer = SlowByteLevelBPE(tokenizer_json=_tokenizer_json(template), model_max_length=1 << 20,
                                     **_SPECS[template]["roles"])
    elif kind == "tiktoken":
        import tempfile
        from tiktoken_tokenizer import TiktokenBPE, write_tiktoken_model
        path = os.path.join(tempfile.mkdtemp(prefix="tiktoken_"), "tiktoken.model")
        write_tiktoken_model(_tokenizer_json(template), path)
        added = {i: t for i, t in fast.added_tokens_decoder.items()}
        tokenizer = TiktokenBPE(vocab_file=path, added_tokens_decoder=added, model_max_length=1 << 20,
                                **_SPECS[template]["roles"])
    else:
        raise ValueError(kind)
    tokenizer.chat_template = fast.chat_template
    assert not tokenizer.is_fast and tokenizer.get_vocab() == fast.get_vocab(), template
    return tokenizer
