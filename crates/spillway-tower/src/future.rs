//! The response future and body of [`RateLimit`](crate::RateLimit).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http_body::{Body, Frame, SizeHint};

/// The future [`RateLimit`](crate::RateLimit) returns: the store's decision,
/// an optional shaping delay, then the inner service's response.
pub type ResponseFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'static>>;

pub use body::ResponseBody;
use body::ResponseBodyProj;

// The projection type that `pin_project!` generates is public and has no
// docs of its own; it lives here so the lint allowance stays this narrow.
#[allow(missing_docs)]
mod body {
    use pin_project_lite::pin_project;

    pin_project! {
        /// The inner service's body, or the body of a response the rate limiter
        /// wrote itself (a 429, a 400, a 503). Its error type is the inner
        /// body's: the limiter's own bodies never fail.
        #[project = ResponseBodyProj]
        #[derive(Debug)]
        pub enum ResponseBody<B> {
            /// The inner service's body.
            Inner { #[pin] body: B },
            /// A body written by the rate limiter.
            Full { data: Option<bytes::Bytes> },
            /// The inner service's body, measured for a budget rule, which
            /// is settled when it ends or is dropped.
            Metered { #[pin] body: B, metering: Box<crate::metered::Metering> },
        }
    }
}

impl<B> ResponseBody<B> {
    pub(crate) fn inner(body: B) -> Self {
        Self::Inner { body }
    }

    pub(crate) fn full(data: impl Into<Bytes>) -> Self {
        let data: Bytes = data.into();
        Self::Full {
            data: (!data.is_empty()).then_some(data),
        }
    }
}

/// A body of the limiter's own (as [`ReadRequest`](crate::ReadRequest)'s
/// 408 is), for a service whose responses carry this body.
impl<B> From<Bytes> for ResponseBody<B> {
    fn from(data: Bytes) -> Self {
        Self::full(data)
    }
}

impl<B: Body<Data = Bytes>> Body for ResponseBody<B> {
    type Data = Bytes;
    type Error = B::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, B::Error>>> {
        match self.project() {
            ResponseBodyProj::Inner { body } => body.poll_frame(cx),
            ResponseBodyProj::Full { data } => Poll::Ready(data.take().map(|d| Ok(Frame::data(d)))),
            ResponseBodyProj::Metered { body, metering } => metering.poll_frame(body, cx),
        }
    }

    fn is_end_stream(&self) -> bool {
        match self {
            Self::Inner { body } => body.is_end_stream(),
            Self::Full { data } => data.is_none(),
            // The end is seen by polling, which settles.
            Self::Metered { .. } => false,
        }
    }

    fn size_hint(&self) -> SizeHint {
        match self {
            Self::Inner { body } => body.size_hint(),
            // A cut stream may end early, and with an event of its own.
            Self::Metered { .. } => SizeHint::default(),
            Self::Full { data } => {
                SizeHint::with_exact(data.as_ref().map_or(0, |d| d.len() as u64))
            }
        }
    }
}
