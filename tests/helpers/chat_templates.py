"""Chat templates in the style of three model families, for the tool-calling tests (no tests
here). Written for these tests: each renders tools, assistant tool calls and tool results the way
its family does, in a few lines instead of the real templates' hundreds.

    QWEN    ChatML; tools as JSON inside <tools></tools> in the system turn; calls as
            <tool_call>{"name", "arguments"}</tool_call>; results in a user turn inside
            <tool_response>; `enable_thinking=false` pre-fills an empty <think></think>
    LLAMA3  Llama 3.1 headers; tools as JSON in the first user turn; calls as
            {"name", "parameters"}; results in an `ipython` turn
    GLM45   GLM-4.5 role tokens; calls as <tool_call>name<arg_key>k</arg_key><arg_value>v
            </arg_value></tool_call>; results in an <|observation|> turn
"""

QWEN = """\
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}# Tools

You may call one or more functions to assist with the user query.

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, return a json object with function name and arguments within \
<tool_call></tool_call> XML tags.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|im_start|>user
<tool_response>
{{ m.content }}
</tool_response><|im_end|>
{% elif m.role != 'system' %}<|im_start|>{{ m.role }}
{% if m.reasoning_content %}<think>
{{ m.reasoning_content }}
</think>

{% endif %}{{ m.content }}
{%- for tc in m.tool_calls or [] %}
<tool_call>
{"name": "{{ tc.function.name }}", "arguments": {{ tc.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% endif %}{% endif %}"""

LLAMA3 = """\
<|begin_of_text|>
{%- for m in messages %}
{%- if m.role == 'user' and tools and loop.first %}<|start_header_id|>user<|end_header_id|>

Given the following functions, please respond with a JSON for a function call with its proper \
arguments that best answers the given prompt.

Respond in the format {"name": function name, "parameters": dictionary of argument name and its \
value}.

{% for tool in tools %}{{ tool | tojson }}

{% endfor %}{{ m.content }}<|eot_id|>
{%- elif m.role == 'assistant' and m.tool_calls %}<|start_header_id|>assistant<|end_header_id|>

{% for tc in m.tool_calls %}{"name": "{{ tc.function.name }}", "parameters": \
{{ tc.function.arguments | tojson }}}{% endfor %}<|eot_id|>
{%- elif m.role == 'tool' %}<|start_header_id|>ipython<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- else %}<|start_header_id|>{{ m.role }}<|end_header_id|>

{{ m.content }}<|eot_id|>
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>

{% endif %}"""

GLM45 = """\
[gMASK]<sop>
{%- if tools %}<|system|>
# Tools

You may call one or more functions to assist with the user query.

<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>

For each function call, output the function name and arguments within the following XML \
format:
<tool_call>{function-name}
<arg_key>{arg-key-1}</arg_key>
<arg_value>{arg-value-1}</arg_value>
</tool_call>
{%- endif %}
{%- for m in messages %}
{%- if m.role == 'tool' %}<|observation|>
<tool_response>
{{ m.content }}
</tool_response>
{%- elif m.role == 'assistant' %}<|assistant|>
{{ m.content }}
{%- for tc in m.tool_calls or [] %}
<tool_call>{{ tc.function.name }}
{% for k, v in tc.function.arguments.items() %}<arg_key>{{ k }}</arg_key>
<arg_value>{{ v if v is string else v | tojson }}</arg_value>
{% endfor %}</tool_call>
{%- endfor %}
{%- else %}<|{{ m.role }}|>
{{ m.content }}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|assistant|>{% endif %}"""
