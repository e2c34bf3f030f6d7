#!/bin/bash
# Deploy the web app to the app servers: build, upload, switch, restart.

APP=storefront
HOSTS="app1.internal app2.internal"
RELEASE=$(date +%Y%m%d%H%M%S)
BUILD_DIR=$(mktemp -d)
REMOTE_ROOT=/srv/$APP
CHAT_HOOK=${CHAT_HOOK:-}

echo "building $APP release $RELEASE"
git archive --format=tar HEAD | tar -x -C "$BUILD_DIR"
cd "$BUILD_DIR"
npm ci --omit=dev
npm run build
tar -czf "/tmp/$APP-$RELEASE.tar.gz" -C "$BUILD_DIR" .

for host in $HOSTS; do
    echo "deploying to $host"
    scp "/tmp/$APP-$RELEASE.tar.gz" "deploy@$host:/tmp/"
    ssh "deploy@$host" "mkdir -p $REMOTE_ROOT/releases/$RELEASE &&
        tar -xzf /tmp/$APP-$RELEASE.tar.gz -C $REMOTE_ROOT/releases/$RELEASE &&
        ln -sfn $REMOTE_ROOT/releases/$RELEASE $REMOTE_ROOT/current &&
        sudo systemctl restart $APP"
    curl -fsS "http://$host:8080/healthz"
done

rm -rf "$BUILD_DIR" "/tmp/$APP-$RELEASE.tar.gz"
echo "deployed $RELEASE to: $HOSTS"
if [ -n "$CHAT_HOOK" ]; then
    curl -s -X POST -H 'Content-Type: application/json' \
        -d "{\"text\": \"$APP $RELEASE deployed to $HOSTS\"}" "$CHAT_HOOK"
fi
