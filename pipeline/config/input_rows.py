"""The `rows` section: how a user's table becomes requests. Which column is the id, the prompt
or the messages; prompts built from the row's columns by a template; columns copied to the
output rows. The defaults are the input contract's own names, so a config without the section
reads `id` and `prompt` or `messages` as before."""

from __future__ import annotations

from typing import Optional

from pydantic import Field, field_validator, model_validator

from pipeline.config.base import Section

# Columns every output row has (schemas.OutputRow) or the pipeline adds: a copied column may not take one's name.
RESERVED_COLUMNS = (
    "id",
    "sample_index",
    "text",
    "finish_reason",
    "stop_reason",
    "parsed",
    "parse_error",
    "reasoning",
    "logprobs",
    "prompt_logprobs",
    "prompt_tokens",
    "generated_tokens",
    "draft_tokens",
    "accepted_tokens",
    "num_drafts",
    "mean_acceptance_length",
    "max_tokens_clipped",
    "model",
    "drafter",
    "lora",
    "source",
    "row",
    "unit_id",
    "attempt",
    "metadata",
    "error_kind",
    "error_field",
    "error_message",
)


def template_environment():
    """Jinja2 in its immutable sandbox, as Hugging Face's chat templates run: a template reads
    the row's values and cannot reach Python's internals or change them. A name the row does
    not have is an error, not an empty string."""
    from jinja2 import StrictUndefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    return ImmutableSandboxedEnvironment(undefined=StrictUndefined, keep_trailing_newline=True, autoescape=False)


def template_columns(source: str) -> set[str]:
    """The names a template reads from its row (its undeclared variables)."""
    from jinja2 import meta

    return set(meta.find_undeclared_variables(template_environment().parse(source)))


def _check_template(field: str, source: str) -> None:
    from jinja2 import TemplateSyntaxError

    try:
        template_environment().parse(source)
    except TemplateSyntaxError as exc:
        raise ValueError(f"{field} does not parse (line {exc.lineno}: {exc.message})") from None


class TemplateMessage(Section):
    """One message of `rows.messages_template`: its role, and its content as a template."""

    role: str = Field(description="system, user or assistant (any role the target's chat template knows).")
    content: str = Field(description="A Jinja2 template over the row's columns, e.g. 'Question: {{ question }}'.")


class InputRowsConfig(Section):
    id_column: str = Field("id", description="The input column of row ids: string or integer (written as a string).")
    prompt_column: str = Field("prompt", description="The input column of prompt text (without a template).")
    messages_column: str = Field("messages", description="The input column of chat messages (without a template).")
    prompt_template: Optional[str] = Field(
        None,
        description=(
            "A Jinja2 template (sandboxed, as chat templates run) over the row's columns that renders each row's "
            "prompt, e.g. 'Passage: {{ context }}\\nQuestion: {{ question }}'. A null value or one the template cannot "
            "render is that row's error (template_error, naming the column)."
        ),
    )
    messages_template: Optional[list[TemplateMessage]] = Field(
        None,
        description=(
            "Chat messages built per row: a list of {role, content} whose contents are Jinja2 templates over the row's "
            "columns, rendered then through the target's chat template (chat section)."
        ),
    )
    copy_columns: list[str] = Field(
        default_factory=list,
        description="Input columns copied, as they are, to each output row of their row (beside metadata).",
    )

    @field_validator("prompt_template")
    @classmethod
    def _prompt_template_parses(cls, value):
        if value is not None:
            if not value.strip():
                raise ValueError("rows.prompt_template is empty; give a template, or leave it out")
            _check_template("rows.prompt_template", value)
        return value

    @field_validator("messages_template")
    @classmethod
    def _messages_template_parses(cls, value):
        if value is not None:
            if not value:
                raise ValueError("rows.messages_template is empty; give at least one message, or leave it out")
            for i, message in enumerate(value):
                _check_template(f"rows.messages_template[{i}].content", message.content)
        return value

    @model_validator(mode="after")
    def _one_template_and_own_names(self):
        if self.prompt_template is not None and self.messages_template is not None:
            raise ValueError("rows.prompt_template and rows.messages_template: give one of them, not both")
        reserved = [c for c in self.copy_columns if c in RESERVED_COLUMNS]
        if reserved:
            raise ValueError(
                f"rows.copy_columns: {reserved[0]!r} is a column every output row has already; rename it in the input, "
                "or leave it out of copy_columns"
            )
        repeated = sorted({c for c in self.copy_columns if self.copy_columns.count(c) > 1})
        if repeated:
            raise ValueError(f"rows.copy_columns names {repeated[0]!r} twice")
        return self

    @property
    def templated(self) -> Optional[str]:
        """The text column a template renders ("prompt" or "messages"), or None without one."""
        if self.prompt_template is not None:
            return "prompt"
        return "messages" if self.messages_template is not None else None

    @property
    def template_columns(self) -> list[str]:
        """The input columns the template reads, in name order."""
        if self.prompt_template is not None:
            return sorted(template_columns(self.prompt_template))
        names: set[str] = set()
        for message in self.messages_template or []:
            names |= template_columns(message.content)
        return sorted(names)

    @property
    def is_default(self) -> bool:
        return self.model_dump() == InputRowsConfig().model_dump()
