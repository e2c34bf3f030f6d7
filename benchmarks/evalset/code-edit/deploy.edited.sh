#!/bin/bash
# Deploy the web app to the app servers: build, upload, switch, restart.
set -euo pipefail

APP=storefront
HOSTS="app1.internal app2.internal"
RELEASE=$(date +%Y%m%d%H%M%S)
BUILD_DIR=$(mktemp -d)
REMOTE_ROOT=/srv/$APP
CHAT_HOOK=${CHAT_HOOK:-}

cleanup() {
    rm -rf "$BUILD_DIR" "/tmp/$APP-$RELEASE.tar.gz"
}
trap cleanup EXIT

fail() {
    echo "deploy: $*" >&2
    exit 1
}

echo "building $APP release $RELEASE"
git archive --format=tar HEAD | tar -x -C "$BUILD_DIR"
cd "$BUILD_DIR"
npm ci --omit=dev || fail "npm ci failed"
npm run build || fail "build failed"
tar -czf "/tmp/$APP-$RELEASE.tar.gz" -C "$BUILD_DIR" .

for host in $HOSTS; do
    echo "deploying to $host"
    scp "/tmp/$APP-$RELEASE.tar.gz" "deploy@$host:/tmp/" || fail "upload to $host failed"
    ssh "deploy@$host" "mkdir -p $REMOTE_ROOT/releases/$RELEASE &&
        tar -xzf /tmp/$APP-$RELEASE.tar.gz -C $REMOTE_ROOT/releases/$RELEASE &&
        ln -sfn $REMOTE_ROOT/releases/$RELEASE $REMOTE_ROOT/current &&
        sudo systemctl restart $APP" || fail "release switch on $host failed"
    curl -fsS --retry 5 --retry-delay 2 "http://$host:8080/healthz" ||
        fail "$host is unhealthy after the restart; stopping before the next host"
done

echo "deployed $RELEASE to: $HOSTS"
if [ -n "$CHAT_HOOK" ]; then
    curl -s -X POST -H 'Content-Type: application/json' \
        -d "{\"text\": \"$APP $RELEASE deployed to $HOSTS\"}" "$CHAT_HOOK" ||
        echo "deploy: chat notification failed (the deploy itself succeeded)" >&2
fi
