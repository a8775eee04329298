"""A user's table in specbatch's row layout, as the config's `rows` section maps it.

Every reader of input rows goes through `RowShape`: a unit's read, the prefix key pass, the
dry run's samples and the drafter probe. So the id column is renamed and written as a
string, a template renders the prompt or the messages from the row's own columns, the copied
columns ride along, and an Arrow type spelled two ways (string and large_string) is one type,
the same in each of them.

A template that cannot render a row does not stop the job: the row keeps a null prompt and
its reason (`template_error`, `template_field`), and the preprocess stage makes it that row's
error.
"""

from __future__ import annotations

from typing import Any, Optional, Sequence

import pyarrow as pa

from pipeline.config.input_rows import InputRowsConfig, template_environment

TEMPLATE_ERROR = "template_error"
# What a shaped table carries beside the unit's columns: a template's failure per row, and the copied columns.
SHAPE_COLUMNS = ("template_error", "template_field", "copied")
MESSAGES_TYPE = pa.list_(pa.struct([pa.field("role", pa.string()), pa.field("content", pa.string())]))
# A row's own sampling columns (schemas.PromptRow), as a unit's block and a converted file carry them.
SAMPLING_FIELDS = [
    pa.field("max_tokens", pa.int64()),
    pa.field("temperature", pa.float64()),
    pa.field("top_p", pa.float64()),
    pa.field("seed", pa.int64()),
    pa.field("n", pa.int64()),
    pa.field("stop", pa.list_(pa.string())),
    pa.field("response_format", pa.string()),
    pa.field("sampling", pa.string()),
]


def plain_type(t: pa.DataType) -> pa.DataType:
    """The type with its 64-bit-offset spellings (large_string, large_binary, large_list) made
    the common ones: pandas and pyarrow write one logical type both ways."""
    if pa.types.is_large_string(t):
        return pa.string()
    if pa.types.is_large_binary(t):
        return pa.binary()
    if pa.types.is_large_list(t) or pa.types.is_list(t):
        return pa.list_(t.value_field.with_type(plain_type(t.value_type)))
    if pa.types.is_struct(t):
        return pa.struct([t.field(i).with_type(plain_type(t.field(i).type)) for i in range(t.num_fields)])
    if pa.types.is_map(t):
        return pa.map_(plain_type(t.key_type), plain_type(t.item_type))
    return t


def plain_column(column: pa.ChunkedArray | pa.Array):
    target = plain_type(column.type)
    return column if target == column.type else column.cast(target)


class RowShape:
    """The config's `rows` section applied to tables read from input files."""

    def __init__(self, rows: Optional[InputRowsConfig] = None):
        self.rows = rows or InputRowsConfig()
        environment = template_environment()
        self.prompt_template = environment.from_string(self.rows.prompt_template) if self.rows.prompt_template else None
        self.message_templates = [
            (m.role, environment.from_string(m.content)) for m in self.rows.messages_template or []
        ]
        self.template_columns = self.rows.template_columns

    @classmethod
    def for_job(cls, config) -> "RowShape":
        return cls(config.rows)

    def __reduce__(
        self,
    ):  # to Ray's tasks and actors: the config, compiled again there (a Jinja2 template does not pickle)
        return RowShape, (self.rows,)

    # ------------------------------------------------------------ what a file must have, and gives

    def text_column(self, names: Sequence[str]) -> list[str]:
        """The row layout's text columns ("prompt", "messages") a file with these columns gives."""
        if self.rows.templated:
            return [self.rows.templated]
        return [
            kind
            for kind, name in (("prompt", self.rows.prompt_column), ("messages", self.rows.messages_column))
            if name in names
        ]

    def missing(self, names: Sequence[str]) -> list[str]:
        """The columns the `rows` section names that a file lacks, each with the setting that names it."""
        rows = self.rows
        field = "rows.prompt_template" if rows.prompt_template else "rows.messages_template"
        wanted = [(rows.id_column, "rows.id_column" if rows.id_column != "id" else None)]
        wanted += [(c, field) for c in self.template_columns] + [(c, "rows.copy_columns") for c in rows.copy_columns]
        return [f"{name!r}" + (f" ({why})" if why else "") for name, why in wanted if name not in names]

    def source_columns(self, names: Sequence[str], layout: Sequence[str]) -> list[str]:
        """The file's columns (of `names`) to read for the layout's columns `layout`."""
        rows = self.rows
        sources = {
            "id": [rows.id_column],
            "prompt": [rows.prompt_column],
            "messages": [rows.messages_column],
            "copied": rows.copy_columns,
        }
        if rows.templated:  # the template makes the row's text: neither text column is read
            sources.update(prompt=[], messages=[])
            sources[rows.templated] = self.template_columns
        wanted = [c for name in layout for c in sources.get(name, [name])]
        return list(dict.fromkeys(c for c in wanted if c in names))

    # ------------------------------------------------------------ the table in the row layout

    def apply(self, table: pa.Table) -> pa.Table:
        """`table` (a file's columns, as `source_columns` read them) under the layout's names:
        `id` as a string, `prompt` or `messages` (rendered by the template), the other columns
        under their own names, every type in its plain spelling, and the shape's own columns."""
        rows, names = self.rows, table.column_names
        columns: dict[str, Any] = {name: plain_column(table.column(name)) for name in names}
        if rows.id_column in names:
            ids = table.column(rows.id_column)
            columns["id"] = ids.cast(pa.string()) if pa.types.is_integer(ids.type) else plain_column(ids)
        for kind, name in (("prompt", rows.prompt_column), ("messages", rows.messages_column)):
            columns.pop(kind, None)
            if not rows.templated and name in names:
                columns[kind] = plain_column(table.column(name))
        if rows.templated and all(c in names for c in self.template_columns):
            rendered, errors, fields = self.render(table)
            columns[rows.templated] = pa.array(rendered, pa.string() if rows.templated == "prompt" else MESSAGES_TYPE)
            columns["template_error"] = pa.array(errors, pa.string())
            columns["template_field"] = pa.array(fields, pa.string())
        if rows.copy_columns and all(c in names for c in rows.copy_columns):
            copied = [plain_column(table.column(c)).combine_chunks() for c in rows.copy_columns]
            columns["copied"] = pa.StructArray.from_arrays(
                copied, fields=[pa.field(c, a.type) for c, a in zip(rows.copy_columns, copied)]
            )
        return pa.table(columns)

    def render(self, table: pa.Table) -> tuple[list, list, list]:
        """Each row's prompt (or messages) from the template, or its error and the column to blame."""
        rendered, errors, fields = [], [], []
        for values in table.select(self.template_columns).to_pylist():
            null = next((c for c in self.template_columns if values[c] is None), None)
            if null is not None:
                rendered.append(None)
                errors.append(f"column {null!r} is null; the template needs it")
                fields.append(null)
                continue
            try:
                if self.prompt_template is not None:
                    rendered.append(self.prompt_template.render(values))
                else:
                    rendered.append([{"role": role, "content": t.render(values)} for role, t in self.message_templates])
                errors.append(None)
                fields.append(None)
            except Exception as exc:  # the row's values do not fit the template (a type, a missing key)
                rendered.append(None)
                errors.append(f"the template cannot render this row: {type(exc).__name__}: {exc}")
                fields.append("rows.prompt_template" if self.prompt_template is not None else "rows.messages_template")
        return rendered, errors, fields
