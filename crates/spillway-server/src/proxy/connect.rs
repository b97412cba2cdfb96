//! The pool's connectors: any connector (TCP, or an in-memory one in tests)
//! gets the connect timeout, DNS included ([`TimeoutConnector`]), and a cap
//! on the connections open at once ([`Capped`]).

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::Duration;

use http::Uri;
use hyper_util::client::legacy::connect::{Connected, Connection};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tower::Service;

use super::error::{BoxError, ConnectTimedOut, NoSlot};

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

/// Wraps a connector so that at most as many connections as `slots` has
/// permits are open at once, all requests together: each connection holds
/// one until it closes. A connection that finds none free within `wait`
/// fails with [`NoSlot`]. Without it, every request of an HTTP/2 client
/// that the pool cannot serve from an idle connection opens one more, with
/// no bound but the process's file descriptors.
#[derive(Debug, Clone)]
pub(crate) struct Capped<C> {
    pub(crate) inner: C,
    pub(crate) slots: Arc<Semaphore>,
    pub(crate) wait: Duration,
}

impl<C> Service<Uri> for Capped<C>
where
    C: Service<Uri, Error = BoxError>,
    C::Future: Send + 'static,
    C::Response: Send + 'static,
{
    type Response = Held<C::Response>;
    type Error = BoxError;
    type Future = Pin<Box<dyn Future<Output = Result<Held<C::Response>, BoxError>> + Send>>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        // The connection is made only once a slot is had: `inner` is
        // called now (tower's contract after `poll_ready`), its future
        // polled later.
        let connecting = self.inner.call(uri);
        let (slots, wait) = (self.slots.clone(), self.wait);
        Box::pin(async move {
            let slot = match tokio::time::timeout(wait, slots.acquire_owned()).await {
                Ok(Ok(slot)) => slot,
                Ok(Err(_)) | Err(_) => return Err(NoSlot(wait).into()),
            };
            let io = connecting.await?;
            Ok(Held { io, _slot: slot })
        })
    }
}

pin_project_lite::pin_project! {
    /// A connection that holds its slot under [`Capped`] while it is open.
    #[derive(Debug)]
    pub(crate) struct Held<T> {
        #[pin]
        io: T,
        _slot: OwnedSemaphorePermit,
    }
}

impl<T: Connection> Connection for Held<T> {
    fn connected(&self) -> Connected {
        self.io.connected()
    }
}

impl<T: hyper::rt::Read> hyper::rt::Read for Held<T> {
    fn poll_read(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: hyper::rt::ReadBufCursor<'_>,
    ) -> Poll<std::io::Result<()>> {
        self.project().io.poll_read(cx, buf)
    }
}

impl<T: hyper::rt::Write> hyper::rt::Write for Held<T> {
    fn poll_write(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        buf: &[u8],
    ) -> Poll<std::io::Result<usize>> {
        self.project().io.poll_write(cx, buf)
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.project().io.poll_flush(cx)
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<std::io::Result<()>> {
        self.project().io.poll_shutdown(cx)
    }

    fn is_write_vectored(&self) -> bool {
        self.io.is_write_vectored()
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[std::io::IoSlice<'_>],
    ) -> Poll<std::io::Result<usize>> {
        self.project().io.poll_write_vectored(cx, bufs)
    }
}
