"""The admin's change forms: what an operator changed is what they changed in the form."""

from __future__ import annotations

from typing import Any

from django import forms


class OperatorEditForm(forms.ModelForm):
    """A model form whose ``changed_data`` on an existing row is what the operator changed in it.

    Each field carries the value the form was opened with (Django's ``show_hidden_initial``: a
    hidden ``initial-<name>`` input posted back), and a field counts as changed only when the
    posted value differs from that. Compared with the row as read when the form is posted, which
    is Django's default, every field another writer changed while the form was open (another
    operator, the REST API, the launcher moving the render sidecar, a probe writing a vocabulary
    size) would look changed, and saving ``changed_data`` would write the form's stale value back
    over it. A post without the hidden inputs counts every field it sends as changed, as before.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.instance.pk is not None:
            for field in self.fields.values():  # (this form's own copies of the fields)
                field.show_hidden_initial = True
