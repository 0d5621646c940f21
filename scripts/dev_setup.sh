#!/bin/sh
# The dev setup: the package with its test and bench extras, and the repository's git hooks
# (.githooks/commit-msg refuses subjects over 72 characters). Run from anywhere in the checkout;
# NO_INSTALL=1 sets up the hooks only.
set -e
cd "$(git rev-parse --show-toplevel)"
if [ -z "$NO_INSTALL" ]; then
    python -m pip install -e '.[dev,bench]'
fi
git config core.hooksPath .githooks
echo "dev setup: git hooks from .githooks ($(git config core.hooksPath))"
