//! The response future and body of [`RateLimit`](crate::RateLimit).

use std::future::Future;
use std::pin::Pin;
use std::task::{Context, Poll};

use bytes::Bytes;
use http::{HeaderValue, Response};
use http_body::{Body, Frame, SizeHint};
use pin_project_lite::pin_project;

use crate::headers::RateLimitFields;
use crate::metered::Metering;

/// A boxed future of a response: what [`ReadRequest`](crate::ReadRequest)
/// returns, and what [`ResponseFuture`] holds when a request waits (for a
/// store that must be waited for, or for its shaping turn).
pub type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send + 'static>>;

pin_project! {
    /// The future [`RateLimit`](crate::RateLimit) returns, for an inner
    /// service whose future is `F` and whose body is `B`: an admitted
    /// request's inner response (with the rate-limit header fields added
    /// when it comes), an answer of the limiter's own, or a request that
    /// waits (boxed: the store's decision or its shaping turn first).
    /// Not boxed on the paths every request takes.
    pub struct ResponseFuture<F, B, E> {
        #[pin]
        state: State<F, B, E>,
    }
}

pin_project! {
    #[project = StateProj]
    enum State<F, B, E> {
        Inner { #[pin] future: F, finish: Option<Finish> },
        Ready { response: Option<Response<ResponseBody<B>>> },
        Waits { future: BoxFuture<Response<ResponseBody<B>>, E> },
    }
}

impl<F, B, E> ResponseFuture<F, B, E> {
    /// The inner service's future, whose response `finish` completes.
    pub(crate) fn inner(future: F, finish: Finish) -> Self {
        let finish = Some(finish);
        Self {
            state: State::Inner { future, finish },
        }
    }

    /// An answer ready now.
    pub(crate) fn ready(response: Response<ResponseBody<B>>) -> Self {
        let response = Some(response);
        Self {
            state: State::Ready { response },
        }
    }

    /// A request that waits before it is answered.
    pub(crate) fn waits(future: BoxFuture<Response<ResponseBody<B>>, E>) -> Self {
        Self {
            state: State::Waits { future },
        }
    }
}

impl<F, B, E> Future for ResponseFuture<F, B, E>
where
    F: Future<Output = Result<Response<B>, E>>,
{
    type Output = Result<Response<ResponseBody<B>>, E>;

    fn poll(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Self::Output> {
        match self.project().state.project() {
            StateProj::Inner { future, finish } => {
                let res = std::task::ready!(future.poll(cx))?;
                let finish = finish.take().expect("polled after it was ready");
                Poll::Ready(Ok(finish.apply(res)))
            }
            StateProj::Ready { response } => {
                Poll::Ready(Ok(response.take().expect("polled after it was ready")))
            }
            StateProj::Waits { future } => future.as_mut().poll(cx),
        }
    }
}

/// What an admitted request's response gets when it comes: the rate-limit
/// header fields (made when the request was decided), the mark of a
/// `degrade` rule that let it through, and the metering of a budget's
/// response or a concurrency rule's slot.
pub(crate) struct Finish {
    pub(crate) fields: RateLimitFields,
    /// The fields go in the response's extensions ([`FieldsAside`](crate::FieldsAside)).
    pub(crate) aside: bool,
    pub(crate) limited: Option<HeaderValue>,
    pub(crate) metering: Option<Box<Metering>>,
}

impl Finish {
    /// The inner service's response, finished.
    pub(crate) fn apply<B>(self, res: Response<B>) -> Response<ResponseBody<B>> {
        let mut res = match self.metering {
            Some(metering) => metering.start(res),
            None => res.map(ResponseBody::inner),
        };
        if self.aside {
            if !self.fields.is_empty() {
                res.extensions_mut().insert(self.fields);
            }
        } else {
            self.fields.write_to(res.headers_mut());
        }
        let headers = res.headers_mut();
        if let Some(v) = self.limited {
            headers.insert(crate::X_SPILLWAY_LIMITED, v);
        }
        res
    }
}

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
