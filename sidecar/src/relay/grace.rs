//! The end of the shutdown grace period, which every wait of the relay also waits on.

use crate::intake::app::App;

/// Resolves when the sidecar's shutdown grace period is over (never, if it never stops).
pub async fn cut(app: &App) {
    let mut cut = app.cut.clone();
    if cut.wait_for(|&c| c).await.is_err() {
        std::future::pending::<()>().await;
    }
}
