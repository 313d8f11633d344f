"""Forms of the accounts pages."""

from __future__ import annotations

from django import forms
from django.contrib.auth import password_validation
from django.utils.translation import gettext_lazy as _

from apps.accounts.models import User

__all__ = ["SignUpForm"]


class SignUpForm(forms.Form):
    """Email, name and password for a new account.

    Deliberately not a ModelForm: a ModelForm would refuse a taken address with "already
    exists", which tells a stranger who has an account. The service decides that instead.
    """

    email = forms.EmailField(label=_("Email address"), max_length=254)
    name = forms.CharField(label=_("Name"), max_length=200)
    password = forms.CharField(label=_("Password"), strip=False, widget=forms.PasswordInput)

    def clean(self) -> dict[str, object]:
        cleaned = super().clean() or {}
        password = cleaned.get("password")
        if isinstance(password, str):
            candidate = User(email=str(cleaned.get("email") or ""), name=str(cleaned.get("name") or ""))
            try:
                password_validation.validate_password(password, user=candidate)
            except forms.ValidationError as error:
                self.add_error("password", error)
        return cleaned
