"""Chat templates written for the tests in the style of the common model families (the Jinja
features their released templates use: system-message handling with slices and set, role
alternation checks with raise_exception, loop.index0 / loop.first, string methods and filters,
add_generation_prompt, whitespace control and templates laid out over indented lines), and
conversations to render with them. Used by check_chat_templates.py and check_records_finetune.py.
"""
import re

LLAMA2 = (
    "{% if messages[0]['role'] == 'system' %}{% set loop_messages = messages[1:] %}"
    "{% set system_message = messages[0]['content'] %}{% else %}{% set loop_messages = messages %}"
    "{% set system_message = false %}{% endif %}"
    "{% for message in loop_messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if loop.index0 == 0 and system_message != false %}"
    "{% set content = '<<SYS>>\\n' + system_message + '\\n<</SYS>>\\n\\n' + message['content'] %}"
    "{% else %}{% set content = message['content'] %}{% endif %}"
    "{% if message['role'] == 'user' %}{{ bos_token + '[INST] ' + content.strip() + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ ' ' + content.strip() + ' ' + eos_token }}{% endif %}"
    "{% endfor %}")

LLAMA3 = (
    "{% set loop_messages = messages %}{% for message in loop_messages %}"
    "{% set content = '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n'"
    "+ message['content'] | trim + '<|eot_id|>' %}"
    "{% if loop.index0 == 0 %}{% set content = bos_token + content %}{% endif %}{{ content }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

MISTRAL = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if message['role'] == 'user' %}{{ '[INST] ' + message['content'] + ' [/INST]' }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token}}"
    "{% else %}{{ raise_exception('Only user and assistant roles are supported!') }}{% endif %}{% endfor %}")

CHATML = (
    "{% for message in messages %}"
    "{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n' }}{% endif %}"
    "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

GEMMA = (
    "{{ bos_token }}{% if messages[0]['role'] == 'system' %}{{ raise_exception('System role not supported') }}"
    "{% endif %}{% for message in messages %}"
    "{% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}"
    "{{ raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') }}{% endif %}"
    "{% if (message['role'] == 'assistant') %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' + message['content'] | trim + '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")

PHI3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if (message['role'] == 'user') %}{{'<|user|>' + '\n' + message['content'] + '<|end|>' + '\n' + '<|assistant|>' + '\n'}}"
    "{% elif (message['role'] == 'assistant') %}{{message['content'] + '<|end|>' + '\n'}}{% endif %}{% endfor %}")

# ChatML laid out over indented lines, as many released templates are: lstrip_blocks and
# trim_blocks remove the layout, "-" markers and a comment too.
CHATML_LINES = """{#- ChatML, one tag per line -#}
{% for message in messages %}
    {% if loop.first and message.role != 'system' %}
        {{- '<|im_start|>system\\nYou are a helpful assistant.<|im_end|>\\n' -}}
    {% endif %}
    {{- '<|im_start|>' ~ message.role ~ '\\n' ~ message.content ~ '<|im_end|>\\n' -}}
{% endfor %}
{% if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' -}}
{% endif %}
"""

# Gemma 3's constructs in a template of our own: the system message folded into the first
# user turn, content tested with `is string` / `is iterable` (a list of parts), an inline if on
# loop.first, roles checked with `is divisibleby`.
GEMMA3_STYLE = """{{ bos_token }}
{%- if messages[0]['role'] == 'system' -%}
    {%- if messages[0]['content'] is string -%}
        {%- set lead = messages[0]['content'] + '\\n\\n' -%}
    {%- else -%}
        {%- set lead = messages[0]['content'][0]['text'] + '\\n\\n' -%}
    {%- endif -%}
    {%- set turns = messages[1:] -%}
{%- else -%}
    {%- set lead = '' -%}
    {%- set turns = messages -%}
{%- endif -%}
{%- for message in turns -%}
    {%- if (message['role'] == 'user') != (loop.index0 is divisibleby 2) -%}
        {{ raise_exception('Turns must alternate between user and model') }}
    {%- endif -%}
    {{ '<start_of_turn>' ~ ('model' if message['role'] == 'assistant' else message['role']) ~ '\\n'
       ~ (lead if loop.first else '') }}
    {%- if message['content'] is string -%}
        {{ message['content'] | trim }}
    {%- elif message['content'] is iterable -%}
        {%- for part in message['content'] if part['type'] == 'text' -%}
            {{ part['text'] | trim }}
        {%- endfor -%}
    {%- else -%}
        {{ raise_exception('content must be text') }}
    {%- endif -%}
    {{ '<end_of_turn>\\n' }}
{%- endfor -%}
{%- if add_generation_prompt -%}
    {{ '<start_of_turn>model\\n' }}
{%- endif -%}
"""

TEMPLATES = {"llama2": LLAMA2, "llama3": LLAMA3, "mistral": MISTRAL, "chatml": CHATML, "gemma": GEMMA,
             "phi3": PHI3, "chatml_lines": CHATML_LINES, "gemma3_style": GEMMA3_STYLE}
# A template that marks the assistant's reply with {% generation %} (the loss mask follows the
# blocks, as transformers' return_assistant_tokens_mask does) and, as Qwen3's does, shows the
# reasoning of the last turn only.
CHATML_THINK_GENERATION = """{%- for message in messages %}
    {%- if message.role == 'assistant' %}
        {{- '<|im_start|>assistant\\n' }}
        {%- generation %}
            {%- if loop.last and message.reasoning_content is defined %}
                {{- '<think>\\n' + message.reasoning_content.strip() + '\\n</think>\\n\\n' }}
            {%- endif %}
            {{- message.content | trim + '<|im_end|>' }}
        {%- endgeneration %}
        {{- '\\n' }}
    {%- else %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
TEMPLATES_MARKED = {"chatml_think_generation": CHATML_THINK_GENERATION}

# Families whose templates take a system message.
WITH_SYSTEM = {"llama2", "llama3", "chatml", "phi3", "chatml_lines", "gemma3_style"}

# Templates jinja2 (or the engine) refuses to read, and what the refusal must name.
UNSUPPORTED = [
    ("{% for m in messages %}{{ m.content | frobnicate }}{% endfor %}", "no filter named 'frobnicate'"),
    ("{% include 'turn.jinja' %}", "unsupported tag 'include'"),
    ("{% for m in messages recursive %}{{ m.content }}{% endfor %}", "recursive loops"),
]

TOPICS = [("the capital of Poland", "Warsaw is the capital of Poland."),
          ("two plus three", "Two plus three is five."),
          ("the colour of the sky", "On a clear day the sky is blue."),
          ("a word for happy", "Glad means happy."),
          ("the largest planet", "Jupiter is the largest planet."),
          ("the boiling point of water", "Water boils at 100 degrees Celsius at sea level."),
          ("the author of Hamlet", "William Shakespeare wrote Hamlet."),
          ("the opposite of cold", "The opposite of cold is hot.")]


def conversations(n, with_system):
    """n conversations of one or two exchanges, some with a system message; contents with
    surrounding spaces and newlines so strip/trim matter."""
    out = []
    for i in range(n):
        q, a = TOPICS[i % len(TOPICS)]
        q2, a2 = TOPICS[(i * 3 + 1) % len(TOPICS)]
        msgs = []
        if with_system and i % 3 == 0:
            msgs.append({"role": "system", "content": "Answer briefly."})
        msgs.append({"role": "user", "content": "What is %s?" % q + (" " if i % 2 else "")})
        msgs.append({"role": "assistant", "content": a if i % 4 else " " + a + "\n"})
        if i % 2:
            msgs.append({"role": "user", "content": "And %s?" % q2})
            msgs.append({"role": "assistant", "content": a2})
        out.append({"messages": msgs})
    return out


def single_exchanges(n, with_system):
    """The first exchange of each of conversations(n, with_system)."""
    out = []
    for c in conversations(n, with_system):
        m = c["messages"]
        first = 2 if m[0]["role"] == "system" else 1
        out.append({"messages": m[:first + 1]})
    return out


TOOLS = [{"type": "function",
          "function": {"name": "get_weather", "description": "The weather in a city",
                       "parameters": {"type": "object",
                                      "properties": {"city": {"type": "string", "description": "Kraków or Łódź"}},
                                      "required": ["city"]}}}]


def tool_conversations(n, content_of_call="", system=True, reasoning=False):
    """n conversations that call a tool: the question, the assistant's tool call (with
    `content_of_call` as its content; None: a null content), the tool's answer and the reply;
    every other one with a system message when `system`; with `reasoning`, both assistant turns
    carry reasoning_content. Call ids have the 9 characters Mistral's templates require."""
    out = []
    for i in range(n):
        city = ["Kraków", "Łódź", "Gdańsk"][i % 3]
        call = {"role": "assistant", "content": content_of_call,
                "tool_calls": [{"id": "call%05d" % i, "type": "function",
                                "function": {"name": "get_weather", "arguments": {"city": city}}}]}
        reply = {"role": "assistant", "content": "Sunny and %d °C." % (15 + i)}
        if reasoning:
            call["reasoning_content"] = "The user wants the weather in %s: ask the tool." % city
            reply["reasoning_content"] = "The tool answered."
        msgs = [{"role": "user", "content": "Weather in %s?" % city}, call,
                {"role": "tool", "tool_call_id": "call%05d" % i, "name": "get_weather",
                 "content": "sunny, %d °C" % (15 + i)}, reply]
        if system and i % 2:
            msgs.insert(0, {"role": "system", "content": "Be brief."})
        out.append({"messages": msgs, "tools": TOOLS})
    return out


def reasoning_conversations(n):
    """conversations(n, True) with reasoning_content on every assistant turn."""
    out = []
    for c in conversations(n, True):
        m = [dict(x) for x in c["messages"]]
        for k, x in enumerate(m):
            if x["role"] == "assistant":
                x["reasoning_content"] = "Turn %d: recall, then answer." % k
        out.append({"messages": m})
    return out


def reasoning_exchanges(n):
    """Single exchanges whose reply carries reasoning, under each name transformers reads."""
    out = []
    for i, c in enumerate(single_exchanges(n, False)):
        m = [dict(x) for x in c["messages"]]
        m[-1][["reasoning_content", "thinking", "reasoning"][i % 3]] = "The user asks; answer."
        out.append({"messages": m})
    return out


def sharegpt(conv):
    """A conversation as ShareGPT writes it."""
    speaker = {"user": "human", "assistant": "gpt", "system": "system", "tool": "observation"}
    return {"conversations": [{"from": speaker[m["role"]], "value": m["content"]} for m in conv["messages"]]}


def marks_generation(template):
    """Whether the template marks the assistant's text with {% generation %} blocks: the loss
    mask then follows them, as transformers' return_assistant_tokens_mask does."""
    return re.search(r"{%-?\s*generation\s*-?%}", template) is not None


def assistant_spans(tok, template, messages, **kwargs):
    """The token ranges [a, b) each assistant turn adds, by the engine's documented rule,
    computed with transformers: the turn's tokens start where the conversation before it,
    rendered with the generation prompt, stops sharing tokens with the whole, and end where
    the conversation up to it does."""
    def ids(msgs, gen):
        text = tok.apply_chat_template(msgs, chat_template=template, tokenize=False, add_generation_prompt=gen,
                                       **kwargs)
        return tok(text, add_special_tokens=False)["input_ids"]

    def shared(a, b):
        k = 0
        while k < min(len(a), len(b)) and a[k] == b[k]:
            k += 1
        return k

    full = tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=False, **kwargs)
    spans = []
    for k, m in enumerate(messages):
        if m["role"] == "assistant":
            spans.append((shared(ids(messages[:k], True), full), shared(ids(messages[:k + 1], False), full)))
    return full, spans


def qwen3_marked(template):
    """Qwen3's template with each assistant message's text wrapped in a {% generation %} block,
    so that jinja2 itself says which characters of the whole render each assistant message
    wrote: the reference for the engine's rule on templates that render an earlier turn
    otherwise in the whole than alone (contributed_spans)."""
    start = '{%- elif message.role == "assistant" %}'
    end = "{{- '<|im_end|>\\n' }}\n    {%- elif message.role == \"tool\" %}"
    assert template.count(start) == 1 and template.count(end) == 1, "Qwen3's template changed"
    marked = template.replace(start, start + "{%- generation %}")
    return marked.replace(end, end.replace("}}\n", "}}{%- endgeneration %}\n"))


def deepseek_think_marked(template):
    """The current DeepSeek-R1 template (its generation prompt opens a <think> block the turns
    do not have) with each assistant reply in a {% generation %} block."""
    reply = "{{'<｜Assistant｜>' + content + '<｜end▁of▁sentence｜>'}}"
    assert template.count(reply) == 1, "DeepSeek-R1's template changed"
    return template.replace(reply, "{% generation %}" + reply + "{% endgeneration %}")


# Released templates that render an earlier turn otherwise in the whole than alone, or whose
# generation prompt is not where the reply starts, with what marks their assistant messages.
MARKERS = {"qwen3": qwen3_marked, "deepseek-r1-distill-qwen-think": deepseek_think_marked}


def contributed_spans(tok, template, marked, messages, **kwargs):
    """The token ranges [a, b) each assistant message contributes to the render of the whole
    conversation, by the engine's documented rule, computed with transformers and jinja2:
    `marked` is `template` with each assistant message's text in a {% generation %} block; a
    block's characters count from past the longest part of the generation prompt (what
    add_generation_prompt adds to the whole) that they begin with, and the conversation's last
    message, an assistant's, counts to the end of the render; a range [b, e) of characters is the
    tokens from where those of text[:b] stop being the whole's to where those of text[:e] do."""
    from transformers.utils.chat_template_utils import render_jinja_template

    def render(gen):
        return tok.apply_chat_template(messages, chat_template=template, tokenize=False, add_generation_prompt=gen,
                                       **kwargs)

    def shared(text):
        a = tok(text, add_special_tokens=False)["input_ids"]
        k = 0
        while k < min(len(a), len(full)) and a[k] == full[k]:
            k += 1
        return k

    text, prompted = render(False), render(True)
    assert prompted.startswith(text)
    opening = prompted[len(text):]
    rendered, marks = render_jinja_template(conversations=[messages], chat_template=marked,
                                            return_assistant_tokens_mask=True, **tok.special_tokens_map,
                                            **kwargs)
    assert rendered[0] == text, "the marked template renders otherwise"
    full = tok.apply_chat_template(messages, chat_template=template, tokenize=True, return_dict=False, **kwargs)
    spans = []
    for i, (b, e) in enumerate(marks[0]):
        k = 0
        while k < min(len(opening), e - b) and text[b + k] == opening[k]:
            k += 1
        if i + 1 == len(marks[0]) and messages[-1]["role"] == "assistant":
            e = len(text)
        spans.append((shared(text[:b + k]), shared(text[:e])))
    return full, spans


def with_text_parts(convs):
    """The conversations with each message's content as a list of text parts, split after its
    first word, as multimodal templates (Gemma 3's) iterate them."""
    out = []
    for c in convs:
        msgs = []
        for m in c["messages"]:
            m = dict(m)
            head, sep, tail = m["content"].partition(" ")
            m["content"] = [{"type": "text", "text": head + sep}] + ([{"type": "text", "text": tail}] if tail else [])
            msgs.append(m)
        out.append(dict(c, messages=msgs))
    return out


# Gemma 3's layout for its content: a string, or a list of parts it iterates (an image part
# writes <start_of_image>; the engine refuses those).
GEMMA3_PARTS = (
    "{{ bos_token }}{% for message in messages %}"
    "{% if message['role'] == 'assistant' %}{% set role = 'model' %}{% else %}{% set role = message['role'] %}"
    "{% endif %}{{ '<start_of_turn>' + role + '\n' }}"
    "{% if message['content'] is string %}{{ message['content'] | trim }}"
    "{% elif message['content'] is iterable %}{% for item in message['content'] %}"
    "{% if item['type'] == 'image' %}{{ '<start_of_image>' }}"
    "{% elif item['type'] == 'text' %}{{ item['text'] | trim }}{% endif %}{% endfor %}"
    "{% else %}{{ raise_exception('Invalid content type') }}{% endif %}"
    "{{ '<end_of_turn>\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{'<start_of_turn>model\n'}}{% endif %}")
