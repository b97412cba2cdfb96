//! A connector with a deadline: any connector (TCP, or an in-memory one in
//! tests) gets the connect timeout, DNS included.

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use tower::Service;

use super::error::{BoxError, ConnectTimedOut};

/// Wraps a connector so that a connection not made within `timeout` fails
/// with [`ConnectTimedOut`].
#[derive(Debug, Clone)]
pub(crate) struct TimeoutConnector<C> {
    pub(crate) inner: C,
    pub(crate) timeout: Duration,
}

impl<C> Service<Uri> for TimeoutConnector<C>
where
    C: Service<Uri>,
    C::Error: Into<BoxError>,
    C::Future: Send + 'static,
    C::Response: Send + 'static,
{
    type Response = C::Response;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<C::Response, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx).map_err(Into::into)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let timeout = self.timeout;
        let connecting = self.inner.call(uri);
        Box::pin(async move {
            match tokio::time::timeout(timeout, connecting).await {
                Ok(connected) => connected.map_err(Into::into),
                Err(_) => Err(ConnectTimedOut(timeout).into()),
            }
        })
    }
}
